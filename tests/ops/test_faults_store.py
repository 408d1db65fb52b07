"""The store under faults: a pull killed with SIGKILL halfway, a disk that fills up.

The design (store/local.py): every write lands in a pid-tagged hidden temp directory inside
the store and is renamed into place, so a dead writer never leaves a half model where a
listing or a load would find it; the next pull (or the engine core's start) sweeps the
leftovers of dead writers. These tests kill a real ``python -m mlxd pull`` subprocess at a
moment where it has written part of the model, and check exactly that.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fixtures.gguf_writer import Dims, arch_tensors, llama_metadata, write_gguf
from fixtures.tiny_models import make_tiny_chat_model
from fixtures.wheel_index import wheel_index

# 119 MB of float32 weights: the import takes a second or two on a shared CPU, long enough
# to be killed in the middle.
BIG = Dims(hidden=512, ffn=1408, heads=8, kv_heads=4, layers=10)


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, MLXD_HOME=str(home), HF_HUB_OFFLINE="1", **extra)
    env.pop("MLXD_MODELS__DIR", None)
    return env


def mlxd(env: dict[str, str], *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlxd", *args],
        env=env,
        text=True,
        capture_output=True,
        timeout=timeout,
    )


def listed(env: dict[str, str]) -> list[dict]:
    p = mlxd(env, "list", "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def temp_leftovers(models: Path) -> list[Path]:
    return sorted(models.glob(".tmp-*")) if models.is_dir() else []


def _partly_written(models: Path, pid: int) -> bool:
    """The pull's own install directory holds at least one weight file being written."""
    for d in models.glob(f".tmp-{pid}-*"):
        if "-wheel-" in d.name:
            continue
        for f in d.rglob("*"):
            if f.is_file() and f.suffix == ".safetensors" and f.stat().st_size > 0:
                return True
    return False


def kill_mid_pull(env: dict[str, str], models: Path, *args: str) -> None:
    """Start ``mlxd pull ARGS``, SIGKILL it once it has written part of the model."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxd", "pull", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while not _partly_written(models, proc.pid):
            assert proc.poll() is None, (
                f"the pull ended before it could be killed: {proc.stderr.read()[-2000:]}"
            )
            assert time.monotonic() < deadline, "the pull never started writing"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def _assert_recovers(
    env: dict[str, str],
    models: Path,
    name: str,
    *pull_args: str,
    sweep: Callable[[], None] | None = None,
) -> None:
    # killed halfway: nothing is listed, no directory under the model's name, only hidden
    # temp leftovers of the dead pid
    assert listed(env) == []
    assert not (models / name).exists()
    assert temp_leftovers(models), "the kill came before anything was written"
    if sweep is not None:  # e.g. a server start: its engine core sweeps them too
        sweep()
        assert temp_leftovers(models) == []
    # the next pull sweeps the leftovers and succeeds
    p = mlxd(env, "pull", *pull_args)
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr
    [m] = listed(env)
    assert m["name"] == name and m["kind"] == "chat"
    assert temp_leftovers(models) == []
    stored = models / name
    manifest = json.loads((stored / "mlxd.json").read_text())
    assert manifest["files"]
    for f in manifest["files"]:  # what the manifest promises is what is on disk, whole
        assert (stored / f["name"]).stat().st_size == f["size"], f["name"]


def test_kill_9_in_the_middle_of_a_gguf_pull(tmp_path: Path) -> None:
    gguf = tmp_path / "big-llama.gguf"
    write_gguf(gguf, llama_metadata(dims=BIG), arch_tensors("llama", "F32", dims=BIG))
    env = _env(tmp_path / "home")
    models = tmp_path / "home" / "models"
    kill_mid_pull(env, models, str(gguf), "--as", "big")
    _assert_recovers(env, models, "big", str(gguf), "--as", "big")


PKG, VER, MODULE = "mlxd-fault-model", "1.0.0", "mlxd_fault_model"


def test_kill_9_in_the_middle_of_a_pypi_wheel_pull(
    tmp_path: Path, start_server, tiny_llama: Path
) -> None:
    """Here the next *server start* sweeps the leftovers (the engine core does at start),
    then the pull succeeds."""
    model = make_tiny_chat_model(tmp_path / "src" / "m", "llama", hidden_size=512, num_layers=12)
    index = wheel_index(
        tmp_path, PKG, VER, {f"{MODULE}/model/{f.name}": f for f in model.iterdir()}
    )
    env = _env(tmp_path / "home", MLXD_MODELS__PIP_INDEX_URL=index)
    models = tmp_path / "home" / "models"
    spec = f"pypi:{PKG}=={VER}#{MODULE}/model"
    kill_mid_pull(env, models, spec)

    def server_start() -> None:
        # start_server's store is tmp_path/models; this one is MLXD_HOME/models
        srv = start_server(tiny_llama, models={"dir": str(models)})
        assert srv.health()["status"] == "ok"
        assert PKG not in [m["id"] for m in srv.client().get("/v1/models").json()["data"]]

    _assert_recovers(env, models, PKG, spec, sweep=server_start)


# --------------------------------------------------------------------------------------- #
# A full disk
# --------------------------------------------------------------------------------------- #


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[bool]:
    """A tmpfs of ``size`` at ``path`` when this process may mount one (root), else False."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    try:
        yield r.returncode == 0
    finally:
        if r.returncode == 0:
            subprocess.run(["umount", "-l", str(path)], check=False)


def _copy_until_full(limit: int) -> Callable[..., None]:
    """A stand-in for sources.copy_tree that writes ``limit`` bytes of the first file and
    then fails as a full disk does (ENOSPC), for where no tmpfs can be mounted."""

    def copy_tree(src: Path, out: Path, emit: Callable, *, label: str) -> None:
        first = sorted(f for f in src.iterdir() if f.suffix == ".safetensors")[0]
        with first.open("rb") as fi, (out / first.name).open("wb") as fo:
            fo.write(fi.read(limit))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out / first.name))

    return copy_tree


def test_a_full_disk_during_a_pull(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A clear error naming the cause, nothing half-written left in the store, the store
    usable afterwards. A 1 MiB tmpfs when mounting is permitted (the real ENOSPC, through a
    real `mlxd pull`); else ENOSPC injected into the copy, in-process through the store API."""
    model = make_tiny_chat_model(tmp_path / "src" / "m", "llama", hidden_size=256, num_layers=4)
    size = sum(f.stat().st_size for f in model.iterdir())
    assert size > 1 << 20  # the model cannot fit in 1 MiB
    home = tmp_path / "home"
    models = home / "models"
    with small_tmpfs(models, "1m") as mounted:
        if mounted:
            env = _env(home)
            p = mlxd(env, "pull", str(model), "--as", "t")
            assert p.returncode != 0
            assert "Traceback" not in p.stderr, p.stderr
            last = p.stderr.strip().splitlines()[-1]
            assert last.startswith("mlxd: ") and "No space left on device" in last, p.stderr
            assert listed(env) == []
        else:
            from mlxd.config import ModelSettings
            from mlxd.store import sources
            from mlxd.store.local import ModelStore
            from mlxd.store.pull import pull

            monkeypatch.setattr(sources, "copy_tree", _copy_until_full(256 << 10))
            with pytest.raises(Exception) as err:
                pull(ModelStore(models), str(model), ModelSettings(dir=str(models)), as_name="t")
            assert "No space left on device" in str(err.value)
        assert not (models / "t").exists()
        assert temp_leftovers(models) == []
        leftovers = [f for f in models.rglob("*") if f.is_file() and ".locks" not in f.parts]
        assert leftovers == [], leftovers  # not one byte of the half copy stays
