"""Start and stop a real ``mlxd serve`` for the benchmarks that measure through HTTP."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

# the API's catch-all handler's log record (api/errors.py), not a generated path that
# happens to say "unhandled error" (the fuzzer's strings did, in an access-log line)
UNHANDLED = re.compile(r" ERROR mlxd\.api\.errors: unhandled error\b")


def unhandled_samples(text: str, keep: int = 10, lines: int = 25) -> list[str]:
    """The first ``keep`` "unhandled error" log records with the lines after them (the
    traceback): a count alone says something went wrong, not what."""
    rows = text.splitlines()
    at = [i for i, row in enumerate(rows) if UNHANDLED.search(row)][:keep]
    return ["\n".join(rows[i : i + lines]) for i in at]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(
    home: str, model: str, env: dict[str, str] | None = None, timeout: float = 600
) -> tuple[subprocess.Popen, str]:
    """``mlxd serve --model MODEL`` on a free port with ``MLXD_HOME=home`` and the extra
    ``env`` (settings as MLXD_* variables); returns when /health says 200."""
    port = free_port()
    # a file, not a pipe: a pipe nobody reads fills and blocks the server's logging
    os.makedirs(home, exist_ok=True)
    log = open(os.path.join(home, "serve.log"), "wb")  # noqa: SIM115 - lives with the server
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlxd",
            "serve",
            "--port",
            str(port),
            "--model",
            model,
            "--log-level",
            "warning",
        ],
        env={**os.environ, "MLXD_HOME": home, "HF_HUB_OFFLINE": "1", **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            with open(log.name, "rb") as f:
                raise RuntimeError(f.read().decode(errors="replace")[-2000:])
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("server did not start")


def stop(proc: subprocess.Popen, timeout: float = 120) -> None:
    """SIGTERM (mlxd drains), then kill if it takes longer than ``timeout``."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def commit() -> str | None:
    """The benchmarks' checkout's commit, for a results file (None outside git)."""
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True
        )
        return out.stdout.strip() or None
    except OSError:
        return None
