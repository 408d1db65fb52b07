"""The servers a benchmark starts: mlxd and mlx-lm's server, each a process of its own.

Each runs in a session of its own, so a Ctrl-C at the terminal reaches only the benchmark,
which then stops them with SIGTERM (mlxd drains) and kills what outlives the grace time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


class BenchError(Exception):
    """A benchmark that cannot run as asked: one message for the user."""


class ServerError(BenchError):
    """A server did not start: the message ends with its log's last lines."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(
    url: str,
    paths: tuple[str, ...],
    timeout: float = 300.0,
    proc: subprocess.Popen[bytes] | None = None,
) -> str:
    """Poll ``paths`` under ``url`` until one answers 200; returns that path."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServerError(f"exited with status {proc.returncode}")
        for path in paths:
            try:
                if httpx.get(url + path, timeout=5).status_code == 200:
                    return path
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    raise ServerError(f"{url} not ready after {timeout:.0f} s")


class Server:
    """One server process on a free loopback port, its output in ``log``."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        log: Path,
        env: dict[str, str] | None = None,
        ready: tuple[str, ...] = ("/health", "/v1/models"),
    ) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [*cmd, "--port", str(self.port)]
        self.log = log
        self.env = env
        self.ready = ready
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 300.0) -> Server:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                self.cmd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            wait_ready(self.url, self.ready, timeout, self.proc)
        except ServerError as exc:
            self.stop()
            raise ServerError(
                f"{self.name} did not start ({exc}); the last lines of its log:\n" + self.log_tail()
            ) from None
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def log_tail(self, lines: int = 8) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace: float = 60.0) -> None:
        """SIGTERM, then SIGKILL to the whole process group if it outlives ``grace``."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def mlxd_command(model: str, max_seqs: int, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "mlxd",
        "serve",
        "--model",
        model,
        "--max-num-seqs",
        str(max_seqs),
        "--log-level",
        "warning",
        *extra,
    ]


def mlx_lm_command(model_dir: Path, max_seqs: int, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "mlx_lm",
        "server",
        "--model",
        str(model_dir),
        "--decode-concurrency",
        str(max_seqs),
        *extra,
    ]
