"""`mlxd serve` as a user runs it: a real process, a real port."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from conftest import free_port, wait_healthy
from prometheus_client.parser import text_string_to_metric_families


def _mlxd(*args: str, env: dict, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "mlxd", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def _env(tmp_path) -> dict:
    env = dict(os.environ)
    env.update(MLXD_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1")
    return env


def test_bad_config_file_exits_2_naming_the_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("server:\n  prot: 80\n")
    p = _mlxd("serve", "--config", str(cfg), env=_env(tmp_path))
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 2
    assert "unknown key 'server.prot'" in out
    assert "Traceback" not in out


def test_serve_answers_and_stops_on_sigterm(tmp_path, tiny_llama, tiny_qwen2):
    """Also ``--devices all`` on a host without a GPU: every device MLX has is the CPU, so
    one engine core there (cpu:0), and the log says so."""
    port = free_port()
    env = _env(tmp_path)
    env["MLXD_ENGINE__MAX_NUM_SEQS"] = "4"  # env reaches the process
    p = _mlxd(
        "serve",
        "--model",
        str(tiny_llama),
        "--port",
        str(port),
        "--preload",
        str(tiny_qwen2),
        "--log-format",
        "json",
        "--devices",
        "all",
        env=env,
    )
    try:
        deadline = time.time() + 90
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert p.poll() is None, p.stdout.read()
            assert time.time() < deadline
            time.sleep(0.2)
        assert {m["name"] for m in r.json()["models"]} == {"tiny-llama", "tiny-qwen2"}
        assert {(m["max_num_seqs"], m["max_num_seqs_reason"]) for m in r.json()["models"]} == {
            (4, "engine.max_num_seqs: 4")
        }
        assert [c["device"] for c in r.json()["engine_cores"]] == ["cpu:0"]
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            timeout=30,
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        schema = {
            "type": "json_schema",
            "json_schema": {
                "name": "n",
                "schema": {"type": "object", "properties": {"n": {"type": "integer"}}},
            },
        }
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            timeout=30,
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
                "response_format": schema,
            },
        )
        assert r.status_code == 200
        bad = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"not": {}}}}
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            timeout=30,
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
                "response_format": bad,
            },
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
        # the front end templated, tokenized and detokenized without MLX, and left the
        # grammars (valid or not) to the core without loading llguidance: the engine core
        # owns everything MLX (frontend/tokenizer_side.py) and compiles grammars
        core_pid = httpx.get(f"http://127.0.0.1:{port}/health").json()["engine_core"]["pid"]
        assert _maps(core_pid, "libmlx") and not _maps(p.pid, "libmlx")
        assert _maps(core_pid, "llguidance") and not _maps(p.pid, "llguidance")
    finally:
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=30)
    # uvicorn drains, then re-raises the signal so the exit status says "terminated"
    assert p.returncode in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in out
    assert '"logger": "mlxd.access"' in out  # structured json logs, one line per request
    assert "engine.devices all: MLX sees no GPU, so one engine core on the CPU" in out


def _wait_healthy(url: str, p: subprocess.Popen, timeout: float = 90) -> dict:
    return wait_healthy(
        url,
        p,
        timeout,
        lambda: p.stdout.read() if p.poll() is not None else f"not healthy after {timeout} s",
    )


def _maps(pid: int, library: str) -> bool:
    """Whether process ``pid`` has a library whose path holds ``library`` mapped (Linux's
    /proc): ``libmlx`` for MLX, ``llguidance`` for the grammar engine's extension."""
    return library in Path(f"/proc/{pid}/maps").read_text()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_api_workers_share_one_engine_core(tmp_path, tiny_llama, request):
    """`--api-workers 2`: two front-end processes on one port, one engine core (the model
    loaded once), and SIGTERM takes all of them down."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # the server's own temporary folder, no other test's files in it (short: the engine
    # core's IPC socket paths live there, and a socket path holds 107 bytes at most)
    tmp = Path(tempfile.mkdtemp(prefix="mlxd-"))
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    p = _mlxd(
        "serve",
        "--model",
        str(tiny_llama),
        "--port",
        str(port),
        "--api-workers",
        "2",
        env={**_env(tmp_path), "TMPDIR": str(tmp)},
        start_new_session=True,
    )
    core_pid = None
    try:
        _wait_healthy(url, p)
        assert len(list(tmp.glob("mlxd-metrics-*"))) == 1  # the front ends' shared files
        frontends, cores = set(), set()
        deadline = time.time() + 30
        while len(frontends) < 2 and time.time() < deadline:
            with httpx.Client(timeout=10) as c:  # a new connection each time
                h = c.get(url + "/health")
                if h.status_code == 200:  # a worker may still be starting
                    frontends.add(h.json()["frontend_pid"])
                    cores.add(h.json()["engine_core"]["pid"])
                    assert [m["name"] for m in h.json()["models"]] == ["tiny-llama"]
        assert len(frontends) == 2 and len(cores) == 1 and p.pid not in frontends
        core_pid = cores.pop()
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        for _ in range(6):
            with httpx.Client(timeout=30) as c:
                r = c.post(url + "/v1/chat/completions", json=chat)
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        h = httpx.get(url + "/health").json()
        assert h["model_loads"] == {"tiny-llama": 1}
        # uvicorn's worker processes serve without MLX too (workers.py)
        assert _maps(core_pid, "libmlx") and not any(_maps(pid, "libmlx") for pid in frontends)
        # whichever front end answers a scrape, it counts every front end's requests: one
        # kept-alive connection to each front end, three more chats through each, and a
        # scrape through each
        by_pid: dict[int, httpx.Client] = {}
        deadline = time.time() + 30
        while len(by_pid) < 2 and time.time() < deadline:
            c = httpx.Client(timeout=30)
            pid = c.get(url + "/health").json()["frontend_pid"]
            if pid in by_pid:
                c.close()
            else:
                by_pid[pid] = c
        assert len(by_pid) == 2
        for c in by_pid.values():
            for _ in range(3):
                assert c.post(url + "/v1/chat/completions", json=chat).status_code == 200
        for pid, c in by_pid.items():
            assert c.get(url + "/health").json()["frontend_pid"] == pid  # still that one
            fams = {f.name: f for f in text_string_to_metric_families(c.get(url + "/metrics").text)}
            c.close()
            done = fams["mlxd:request_success"].samples
            assert sum(s.value for s in done if s.name.endswith("_total")) == 12
            assert all("pid" not in s.labels for s in done)
            tokens = fams["mlxd:generation_tokens"].samples
            assert sum(s.value for s in tokens if s.name.endswith("_total")) == 36
            running = fams["mlxd:num_requests_running"].samples
            assert all("pid" not in s.labels for s in running)
            assert sum(s.value for s in running) == 0
            # the core's families once (from the core, not from either front end's files)
            assert [
                s.value
                for s in fams["mlxd:models_loaded"].samples
                if s.labels.get("kind") == "chat"
            ] == [1]
            assert any(f.startswith("process_") for f in fams)
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
    deadline = time.time() + 10
    while core_pid is not None and _alive(core_pid) and time.time() < deadline:
        time.sleep(0.1)
    assert core_pid is None or not _alive(core_pid)
    # the front ends' shared metric files go with the server
    assert not list(tmp.glob("mlxd-metrics-*"))


def test_max_num_seqs_flag_takes_auto_or_a_number(tmp_path, tiny_llama):
    """``--max-num-seqs auto`` sizes the model's batch at load (the log line and /health say
    how); a value that is neither is a configuration error naming the key."""
    bad = _mlxd("serve", "--model", str(tiny_llama), "--max-num-seqs", "many", env=_env(tmp_path))
    out, _ = bad.communicate(timeout=60)
    assert bad.returncode == 2 and "'engine.max_num_seqs'" in out, out
    assert "'auto' or an integer >= 1" in out and "Traceback" not in out
    port = free_port()
    env = _env(tmp_path)
    env["MLXD_ENGINE__MAX_NUM_SEQS"] = "4"  # the flag wins over the environment
    p = _mlxd(
        "serve", "--model", str(tiny_llama), "--port", str(port), "--max-num-seqs", "auto", env=env
    )
    try:
        health = _wait_healthy(f"http://127.0.0.1:{port}", p)
        model = health["models"][0]
        assert model["max_num_seqs_reason"].startswith("auto: ")
        assert model["max_num_seqs"] == 32  # the CPU cap: a tiny model fits far more
    finally:
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=30)
    assert "model tiny-llama: max_num_seqs 32 (auto: " in out


def test_devices_this_host_lacks_exit_2_saying_what_it_has(tmp_path):
    for spec, message in [
        ("3", "no GPU 3 (MLX sees 0 GPU(s)); on the CPU use cpu or cpu:N"),
        ("gpu:x", "expected all, a list of GPU indices"),
    ]:
        p = _mlxd("serve", "--devices", spec, "--port", str(free_port()), env=_env(tmp_path))
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 2, out
        assert message in out and "Traceback" not in out


def test_split_models_with_several_devices_or_both_splits_exit_2(tmp_path):
    """A rank group per device is not built yet (one check for both kinds of split); nor are
    both kinds of split at once."""
    for args, message in [
        (
            ("--devices", "cpu:2", "--pipeline-parallel", "2"),
            "engine.pipeline_parallel > 1 cannot be combined yet",
        ),
        (("--tensor-parallel", "2", "--pipeline-parallel", "2"), "cannot both be above 1"),
    ]:
        p = _mlxd("serve", *args, "--port", str(free_port()), env=_env(tmp_path))
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 2, out
        assert message in out and "Traceback" not in out


def test_api_workers_each_reach_every_engine_core(tmp_path, tiny_llama):
    """`--devices cpu:2 --api-workers 2`: both front ends talk to both cores (one copy of
    the model per core), and SIGTERM takes the cores down too."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    p = _mlxd(
        "serve",
        "--model",
        str(tiny_llama),
        "--port",
        str(port),
        "--api-workers",
        "2",
        "--devices",
        "cpu:2",
        env=_env(tmp_path),
        start_new_session=True,
    )
    core_pids: set[int] = set()
    try:
        _wait_healthy(url, p)
        seen: dict[int, list[int]] = {}
        deadline = time.time() + 30
        while len(seen) < 2 and time.time() < deadline:
            with httpx.Client(timeout=10) as c:  # a new connection each time
                h = c.get(url + "/health")
                if h.status_code == 200:
                    seen[h.json()["frontend_pid"]] = [c["pid"] for c in h.json()["engine_cores"]]
        assert len(seen) == 2
        views = list(seen.values())
        assert views[0] == views[1] and len(set(views[0])) == 2
        core_pids = set(views[0])
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        for _ in range(4):
            with httpx.Client(timeout=30) as c:
                r = c.post(url + "/v1/chat/completions", json=chat)
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        h = httpx.get(url + "/health").json()
        assert h["model_loads"] == {"tiny-llama": 2}
        assert sum(c["requests_total"] for c in h["engine_cores"]) == 4
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
    deadline = time.time() + 10
    while any(_alive(pid) for pid in core_pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in core_pids)


def test_allowed_origins_and_hosts_flags(tmp_path, tiny_llama):
    """Comma-separated flags over the environment's list; a bad entry exits 2 naming it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = _env(tmp_path)
    env["MLXD_SERVER__ALLOWED_ORIGINS"] = "http://env.example"  # the flag wins
    p = _mlxd(
        "serve",
        "--model",
        str(tiny_llama),
        "--port",
        str(port),
        "--allowed-origins",
        "http://app.example, https://ui.example:8443",
        "--allowed-hosts",
        "mlxd.example.com,*.lan",
        env=env,
    )
    try:
        _wait_healthy(url, p)
        with httpx.Client(base_url=url, timeout=30) as c:
            for origin in ("http://app.example", "https://ui.example:8443"):
                r = c.get("/v1/models", headers={"Origin": origin})
                assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
            for origin in ("http://env.example", "http://evil.example"):
                assert c.get("/v1/models", headers={"Origin": origin}).status_code == 403
            for host in ("mlxd.example.com:8000", "box.lan", f"localhost:{port}"):
                assert c.get("/api/tags", headers={"Host": host}).status_code == 200, host
            r = c.get("/api/tags", headers={"Host": "evil.example"})
            assert r.status_code == 403 and "server.allowed_hosts" in r.json()["error"]
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
    p = _mlxd(
        "serve",
        "--allowed-hosts",
        "http://mlxd.example.com",
        "--port",
        str(free_port()),
        env=_env(tmp_path),
    )
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 2, out
    assert "server.allowed_hosts" in out and "not a host name" in out
    assert "Traceback" not in out


def test_pipeline_decode_flag_sets_its_key(tmp_path, tiny_llama):
    """``--pipeline-decode`` is engine.pipeline_decode: a value other than auto, on or off
    is a configuration error naming the key."""
    p = _mlxd(
        "serve", "--model", str(tiny_llama), "--pipeline-decode", "sometimes", env=_env(tmp_path)
    )
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 2 and "'engine.pipeline_decode'" in out, out
    assert "Traceback" not in out
