"""Start and stop a real ``mlxd serve`` for the benchmarks that measure through HTTP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(home: str, model: str, env: dict[str, str] | None = None,
          timeout: float = 600) -> tuple[subprocess.Popen, str]:
    """``mlxd serve --model MODEL`` on a free port with ``MLXD_HOME=home`` and the extra
    ``env`` (settings as MLXD_* variables); returns when /health says 200."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlxd", "serve", "--port", str(port),
                             "--model", model, "--log-level", "warning"],
                            env={**os.environ, "MLXD_HOME": home, "HF_HUB_OFFLINE": "1",
                                 **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(proc.stderr.read().decode()[-2000:])
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
