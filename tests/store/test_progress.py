"""Progress of pulls and imports: throttled server-log lines, and what `mlxd pull` shows.

The CLI test runs `mlxd pull` on a pseudo-terminal, as a person would, so rich draws its
bars (the import now reports bytes per tensor, so a GGUF import gets one too); off a
terminal the same events give one line per step.
"""

from __future__ import annotations

import logging
import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.gguf_writer import K_DIMS, arch_tensors, llama_metadata, write_gguf

from mlxd.config import ModelSettings
from mlxd.store.local import ModelStore
from mlxd.store.progress import ProgressLog, human_bytes
from mlxd.store.pull import pull

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_log_is_throttled(caplog):
    clock = FakeClock()
    plog = ProgressLog(logging.getLogger("t"), "pull x", interval=5.0, clock=clock)
    ev = {"status": "downloading x", "digest": "d", "total": 10_000_000}
    with caplog.at_level(logging.INFO, logger="t"):
        plog({"status": "pulling manifest"})
        for i in range(50):  # 10 events a second for 5 s: the first one only
            clock.now = i / 10
            plog({**ev, "completed": i * 100_000})
        clock.now = 5.0
        plog({**ev, "completed": 5_000_000})  # 5 s since the last line
        clock.now = 6.0
        plog({**ev, "completed": 10_000_000})  # done: always logged, once
        plog({**ev, "completed": 10_000_000})
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "pull x: pulling manifest",
        "pull x: downloading x 0 B / 10.0 MB (0%, 0 B/s)",
        "pull x: downloading x 5.0 MB / 10.0 MB (50%, 1.0 MB/s)",
        "pull x: downloading x 10.0 MB / 10.0 MB (100%, 1.7 MB/s)",
    ]
    assert human_bytes(999) == "999 B" and human_bytes(1_500_000_000) == "1.5 GB"


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("g") / "Tiny-K.Q8_0.gguf"
    write_gguf(path, llama_metadata("llama", K_DIMS), arch_tensors("llama", "Q8_0", dims=K_DIMS))
    return path


def test_pull_logs_import_progress(tmp_path, gguf, caplog):
    events = []
    with caplog.at_level(logging.INFO, logger="mlxd.store.pull"):
        pull(
            ModelStore(tmp_path / "models"),
            str(gguf),
            ModelSettings(dtype="float32"),
            progress=events.append,
        )
    status = "importing Tiny-K.Q8_0.gguf (float32)"
    byte_events = [e for e in events if e.get("status") == status and "total" in e]
    counts = [e["completed"] for e in byte_events]
    total = byte_events[0]["total"]
    assert len(counts) > 5 and counts == sorted(counts) and counts[-1] == total  # per tensor
    assert 0.9 * gguf.stat().st_size < total <= gguf.stat().st_size  # the tensor data
    logged = [r.getMessage() for r in caplog.records if r.name == "mlxd.store.pull"]
    assert any(line.startswith(f"pull {gguf}: {status}") and "(100%," in line for line in logged)
    assert f"pull {gguf}: success" in logged


def _run_on_a_terminal(args: list[str], env: dict) -> str:
    main, child = pty.openpty()
    proc = subprocess.Popen(args, stdin=child, stdout=child, stderr=child, env=env, close_fds=True)
    os.close(child)
    out = b""
    while True:
        ready, _, _ = select.select([main], [], [], 120)
        if not ready:
            proc.kill()
            raise AssertionError("mlxd pull hung; output so far: " + out.decode())
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    proc.wait(timeout=60)
    os.close(main)
    assert proc.returncode == 0, out.decode(errors="replace")
    return ANSI.sub("", out.decode(errors="replace"))


def test_cli_pull_draws_a_bar_with_bytes_and_rate(tmp_path, gguf):
    env = dict(
        os.environ,
        MLXD_HOME=str(tmp_path / "home"),
        HF_HUB_OFFLINE="1",
        COLUMNS="160",
        TERM="xterm",
    )
    env.pop("MLXD_MODELS__DIR", None)
    screen = _run_on_a_terminal([sys.executable, "-m", "mlxd", "pull", str(gguf)], env)
    bar = [
        line for line in screen.splitlines() if "importing Tiny-K.Q8_0.gguf" in line and "━" in line
    ]
    assert bar, screen
    final = bar[-1]
    assert re.search(r"\d+(\.\d+)?/\d+(\.\d+)? [kM]B", final), final  # bytes done / total
    assert re.search(r"\d+(\.\d+)? [kMG]?B/s", final), final  # the rate
    assert "Tiny-K.Q8_0: chat" in screen


def test_cli_pull_off_a_terminal_prints_each_step_once(tmp_path, gguf):
    env = dict(os.environ, MLXD_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1")
    env.pop("MLXD_MODELS__DIR", None)
    p = subprocess.run(
        [sys.executable, "-m", "mlxd", "pull", str(gguf)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == 0, p.stderr
    # a log or CI gets the steps, not one line per tensor of the import
    assert p.stderr.splitlines() == [
        "pulling manifest",
        "importing Tiny-K.Q8_0.gguf (float32)",
        "verifying sha256 digest",
        "writing manifest",
        "success",
    ]
