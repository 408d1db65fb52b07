"""Shared fixtures: tiny real-architecture models and a live mlxd server on a free port."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the hub


# -- every test in a home of its own ---------------------------------------------------------
# HOME, MLXD_HOME, the XDG folders and HF_HOME point into temporary folders: first one for
# the whole run (collection and session fixtures), then a fresh one for each test. The real
# homes are watched: a test that adds or removes anything there fails, naming the paths.


def _home_env(root: Path) -> dict[str, str]:
    return {
        "HOME": str(root),
        "MLXD_HOME": str(root / ".mlxd"),
        "XDG_CONFIG_HOME": str(root / ".config"),
        "XDG_CACHE_HOME": str(root / ".cache"),
        "XDG_DATA_HOME": str(root / ".local" / "share"),
        "XDG_STATE_HOME": str(root / ".local" / "state"),
        "HF_HOME": str(root / ".cache" / "huggingface"),
    }


def _entries(root: Path, depth: int = 2) -> set[str]:
    """The paths up to ``depth`` levels below ``root`` (cheap enough to take per test)."""
    if depth < 0 or not root.is_dir() or root.is_symlink():
        return set()
    out = set()
    with contextlib.suppress(OSError):  # a folder removed while being read: seen next time
        for child in root.iterdir():
            out.add(str(child))
            out |= _entries(child, depth - 1)
    return out


# the developer's own store and homes, as they were before this run
_REAL_HOMES = [Path(p).expanduser() for p in {os.environ.get("MLXD_HOME") or "~/.mlxd", "~/.mlxd"}]


def _real_state() -> set[str]:
    return set().union(
        *({f"{h} (exists)"} if h.exists() else set() for h in _REAL_HOMES),
        *(_entries(h) for h in _REAL_HOMES),
    )


_real_seen = [_real_state()]
_run_home = Path(tempfile.mkdtemp(prefix="mlxd-test-home-"))
os.environ.update(_home_env(_run_home))
_real_at_start = _real_seen[0]


@pytest.fixture(autouse=True)
def _own_home(tmp_path_factory, monkeypatch) -> Iterator[Path]:
    """A fresh home for the test; afterwards, the real homes must be as they were."""
    home = tmp_path_factory.mktemp("home")
    for k, v in _home_env(home).items():
        monkeypatch.setenv(k, v)
    yield home
    now = _real_state()
    changed, _real_seen[0] = sorted(now ^ _real_seen[0]), now
    assert not changed, f"this test (or a fixture it started) changed the real home: {changed[:10]}"


def pytest_sessionfinish(session) -> None:
    """Session fixtures' teardowns run after the last test's check: the run's end checks
    again (in the controller only, which sees what every xdist worker did)."""
    if not hasattr(session.config, "workerinput"):
        changed = sorted(_real_state() ^ _real_at_start)
        if changed:
            session.config.get_terminal_writer().line(
                f"the test run changed the real home: {changed[:10]}", red=True
            )
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    shutil.rmtree(_run_home, ignore_errors=True)


os.environ["MLXD_TEST_FAULTS"] = "1"  # engine cores started by tests take failure drills

# The optimised BLAS the server loads (mlxd.blas), loaded here too before anything imports
# MLX: real-weight tests (SmolLM2 as an LLM reranker) run ~20x faster. MLXD_BLAS=off keeps
# MLX's reference BLAS.
from mlxd import blas  # noqa: E402

blas.preload(os.environ.get("MLXD_BLAS", "auto"))

from fixtures.tiny_models import make_tiny_chat_model  # noqa: E402

# -- tiers (markers registered in pyproject.toml; CONTRIBUTING.md says how to run each) -------
# Whole files by their path below tests/; a single slow test in a fast file carries
# @pytest.mark.slow itself. A campaign also runs serial: it loads the machine on purpose.
_TIER_FILES = {
    "browser": {"ui/test_ui_browser.py", "ui/test_ui_usage.py"},
    "campaign": {"ops/test_fuzz.py", "ops/test_soak.py"},
    "slow": {
        # `mlxd serve`, `mlxd start` or the CLI as subprocesses
        "cli/test_serve.py",
        "cli/test_models_cli.py",
        "cli/test_doctor.py",
        "cli/test_bench.py",
        "ops/test_ops_daemon.py",
        "ops/test_deploy.py",
        "ops/test_packaging.py",
        "ops/test_tensor_parallel.py",
        "ops/test_data_parallel.py",
        "ops/test_ratelimit_redis.py",
        "ops/test_faults_store.py",
        "ops/test_tracing.py",
        "ops/test_usage.py",
        "store/test_hub_pull.py",
        # servers started, killed and restarted per test, or real weights
        "ops/test_ops_resilience.py",
        "ops/test_faults_serving.py",
        "runtime/test_model_manager.py",
        "api/test_prefix_disk.py",
        "api/test_vision.py",
        "api/test_real_model.py",
    },
}


def pytest_collection_modifyitems(config, items) -> None:
    root = Path(__file__).parent
    for item in items:
        if not item.path.is_relative_to(root):
            continue
        rel = item.path.relative_to(root).as_posix()
        for marker, files in _TIER_FILES.items():
            if rel in files:
                item.add_marker(marker)
        if item.get_closest_marker("campaign"):
            item.add_marker("serial")


def require(module: str):
    """An optional extra's module for a test module. Outside CI a missing one skips (a
    developer may install only some extras); under CI, where scripts/test.sh installs every
    extra the tests use, a missing one fails instead of skipping what it should prove."""
    if os.environ.get("CI"):
        import importlib

        return importlib.import_module(module)
    return pytest.importorskip(module)


def require_chromium() -> str | None:
    """Debian's chromium for the browser tests: outside CI a machine without it skips them
    (apt-get install chromium); under CI, which installs it, its absence fails them."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None and not os.environ.get("CI"):
        pytest.skip(
            "Debian's chromium is not installed (apt-get install chromium; on CI its "
            "absence fails these tests)",
            allow_module_level=True,
        )
    return found


def cli_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment of an `mlxd` command run with its own ``MLXD_HOME`` and no hub."""
    env = dict(os.environ, MLXD_HOME=str(home), HF_HUB_OFFLINE="1", **extra)
    env.pop("MLXD_MODELS__DIR", None)
    return env


def run_mlxd(
    env: dict[str, str], *args: str, ok: bool = True, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """``mlxd ARGS`` as a user runs it: it must succeed (``ok``) or fail, never crash."""
    p = subprocess.run(
        [sys.executable, "-m", "mlxd", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert "Traceback" not in p.stderr + p.stdout, p.stderr
    assert (p.returncode == 0) == ok, f"mlxd {' '.join(args)}: {p.stderr}"
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred, timeout: float = 60.0, every: float = 0.05) -> bool:
    """Poll ``pred`` until it is true (True) or ``timeout`` seconds pass (False): a wait for a
    state, generous so that a loaded machine only makes it slower, never fail."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(every)
    return False


def wait_healthy(url: str, proc, timeout: float, why) -> dict:
    """Poll ``url``/health until an ``mlxd serve`` subprocess answers 200 (its body);
    fails, with ``why()`` (its log, say) as the message, when it exits or time runs out."""
    deadline = time.time() + timeout
    while True:
        try:
            r = httpx.get(url + "/health", timeout=2)
            if r.status_code == 200:
                return r.json()
        except httpx.TransportError:
            pass
        assert proc.poll() is None, why()
        assert time.time() < deadline, why()
        time.sleep(0.2)


def core_call(url: str, request):
    """A call (a request struct of enginecore/protocol.py) to the engine core of the
    `mlxd serve` subprocess at ``url``, made as its front ends make it (the core's run
    directory is its command-line argument); a fault drill needs MLXD_TEST_FAULTS=1 in that
    server's environment."""
    import asyncio

    from mlxd.frontend.client import CoreClient

    pid = httpx.get(url + "/health", timeout=10).json()["engine_core"]["pid"]
    run_dir = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[3].decode()

    async def call():
        c = CoreClient(run_dir)
        await c.start()
        try:
            await c.wait_ready(30)
            return await c.call(request)
        finally:
            await c.close()

    return asyncio.run(call())


class LiveServer:
    """mlxd's real app under uvicorn in a background thread, reached over real HTTP."""

    def __init__(self, settings) -> None:
        import uvicorn

        from mlxd.api.app import create_app

        self.settings = settings
        self.app = create_app(settings)
        self.runtime = self.app.state.runtime
        self.port = settings.server.port
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                host="127.0.0.1",
                port=self.port,
                log_config=None,
                access_log=False,
                log_level="warning",
            )
        )
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.exit_code: int | None = None

    def _run(self) -> None:
        # uvicorn ends a failed startup with sys.exit(3); in a thread that is an unhandled
        # exception (a pytest warning), where tests of startup failures expect an outcome
        try:
            self._server.run()
        except SystemExit as exc:
            self.exit_code = exc.code if isinstance(exc.code, int) else 1

    def start(self) -> LiveServer:
        self._thread.start()
        # generous: a real model's pull, load and warm-up on a busy 2-core host took >120 s
        deadline = time.time() + 600
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"server failed to start (exit code {self.exit_code})")
            if time.time() > deadline:
                raise TimeoutError("server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 60), **kw)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def core(self, request, *, index: int = 0):
        """A call to one of this server's engine cores (``p.Status()``, ``p.Loaded()``,
        fault drills...): its result struct."""
        import asyncio

        rt = self.runtime
        return asyncio.run_coroutine_threadsafe(
            rt.cores.clients[index].call(request), rt.loop
        ).result(60)

    def fault(self, kind: str, *, index: int = 0, **args) -> None:
        """A failure drill in an engine core (enginecore/calls.py ``fault``)."""
        import contextlib

        from mlxd.enginecore.protocol import Fault

        request = Fault(kind, **args)  # a misspelt argument fails here, not silently
        with contextlib.suppress(Exception):  # "kill" and "abort" never answer
            self.core(request, index=index)

    @property
    def core_pid(self) -> int:
        return self.runtime.cores.clients[0].core_pid

    @property
    def core_pids(self) -> list[int]:
        return [c.core_pid for c in self.runtime.cores.clients]


def make_settings(home: Path, model: str | Path, **sections):
    from mlxd.config import Settings

    data = {
        "server": {"port": free_port()},
        "models": {"default": str(model), "dir": str(home / "models"), "auto_download": False},
        # the prefix cache's disk tier stays inside the test's home, never ~/.mlxd
        "engine": {"prefix_cache_dir": str(home / "prefix-cache")},
    }
    for k, v in sections.items():
        data.setdefault(k, {}).update(v)
    return Settings(**data)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny-llama", "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny-qwen2", "qwen2")


@pytest.fixture(scope="session")
def long_llama(tmp_path_factory) -> Path:
    """A slower, long-context tiny model, for requests that must still run when we act."""
    return make_tiny_chat_model(
        tmp_path_factory.mktemp("m") / "long-llama",
        "llama",
        hidden_size=256,
        num_layers=4,
        max_position_embeddings=8192,
        seed=1,
    )


@pytest.fixture(scope="session")
def server(tmp_path_factory, tiny_llama, tiny_qwen2) -> Iterator[LiveServer]:
    home = tmp_path_factory.mktemp("home")
    s = make_settings(
        home, tiny_llama, models={"preload": [str(tiny_qwen2)]}, engine={"max_num_seqs": 32}
    )
    srv = LiveServer(s).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def tool_qwen2(tmp_path_factory) -> Path:
    """A tiny qwen2 whose chat template speaks tools (Qwen2.5's syntax), 2048 tokens."""
    from fixtures.tool_models import QWEN25_TOOL_TEMPLATE, with_chat_template

    base = tmp_path_factory.mktemp("m")
    src = make_tiny_chat_model(base / "src", "qwen2", max_position_embeddings=2048)
    return with_chat_template(src, base / "tool-qwen2", QWEN25_TOOL_TEMPLATE)


@pytest.fixture(scope="session")
def thinking_qwen3(tmp_path_factory) -> Path:
    """A tiny Qwen3 whose template opens a thinking part (``<think>`` tokens in its
    vocabulary): its replies come back as reasoning. As slow as long-llama, so that the
    web UI's test sees the reasoning arrive in pieces; 2048 tokens."""
    from fixtures.thinking_models import make_tiny_thinking_model

    return make_tiny_thinking_model(
        tmp_path_factory.mktemp("m") / "thinking-qwen3",
        hidden_size=256,
        num_layers=4,
        max_position_embeddings=2048,
        seed=2,
    )


@pytest.fixture(scope="session")
def plain_llama(tmp_path_factory) -> Path:
    """A tiny llama with a plain ChatML template (no tools in it), 2048 tokens."""
    return make_tiny_chat_model(
        tmp_path_factory.mktemp("m") / "plain-llama", "llama", max_position_embeddings=2048, seed=3
    )


@pytest.fixture(scope="session")
def agent_server(tmp_path_factory, tool_qwen2, plain_llama) -> Iterator[LiveServer]:
    """Tools, structured output, Anthropic and Responses: a template with tools (default
    model) and one without (tools through the fallback prompt)."""
    home = tmp_path_factory.mktemp("agent-home")
    # prefix_cache_min_tokens 0: the tiny prompts here must still hit the prefix cache
    srv = LiveServer(
        make_settings(
            home,
            tool_qwen2,
            models={"preload": [str(plain_llama)]},
            engine={"max_num_seqs": 32, "prefix_cache_min_tokens": 0},
        )
    ).start()
    yield srv
    srv.stop()


@pytest.fixture()
def start_server(tmp_path) -> Iterator:
    """Factory for a private server with custom settings; stopped after the test."""
    started: list[LiveServer] = []

    def _start(model, **sections) -> LiveServer:
        srv = LiveServer(make_settings(tmp_path, model, **sections)).start()
        started.append(srv)
        return srv

    yield _start
    for srv in started:
        srv.stop()


def install_into_store(models_dir: Path, name: str, src: Path) -> Path:
    """Put a model directory into a store the way a pull would (atomic, with a manifest)."""
    import shutil

    from mlxd.store.local import ModelStore

    def copy(out: Path) -> dict:
        for f in src.iterdir():
            shutil.copy2(f, out / f.name)
        return {"format": "mlx"}

    return ModelStore(models_dir).install(name, copy, kind="chat", source=str(src))
