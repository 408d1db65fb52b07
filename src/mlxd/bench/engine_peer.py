"""``--peer engine``: the engine alone (engine_alone.py) kept loaded in a process of its own.

The child gets what mlxd's engine core gets: the BLAS ``backend.blas`` names, preloaded
before MLX; the core's MLX environment (``backend_env.core_env``); ``models.dtype``. A pass
is one JSON line out and one back; its figures are summed up by ``load.summarise``, as an
HTTP side's are. No MLX in this process.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mlxd.backend_env import core_env
from mlxd.bench.load import summarise
from mlxd.bench.servers import BenchError
from mlxd.config import Settings


class EnginePeer:
    """The engine alone on ``model_dir``, one pass at a time."""

    name = "engine"

    def __init__(self, model_dir: Path, settings: Settings, log: Path) -> None:
        self.options = {
            "blas": settings.backend.blas,
            "dtype": settings.models.dtype,
            "trust_remote_code": settings.models.trust_remote_code,
        }
        self.mlx_env = core_env(settings.backend)
        self.env = {**os.environ, **self.mlx_env}
        self.cmd = [
            sys.executable,
            "-m",
            "mlxd.bench.engine_alone",
            str(model_dir),
            json.dumps(self.options),
        ]
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.loaded: dict[str, Any] = {}
        self._buf = b""

    @property
    def url(self) -> str:
        return f"engine alone, pid {self.pid}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout: float = 600.0) -> EnginePeer:
        """Start the child and wait for its model to load."""
        with open(self.log, "w") as err:
            # a session of its own: a Ctrl-C at the terminal reaches only the benchmark
            self.proc = subprocess.Popen(
                self.cmd,
                env=self.env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                start_new_session=True,
            )
        try:
            self.loaded = json.loads(self._read("READY ", timeout))
        except BenchError as exc:
            self.stop()
            raise BenchError(f"the engine alone did not start: {exc}") from None
        return self

    def run_pass(self, prompts: list[str], concurrency: int, max_tokens: int) -> dict[str, Any]:
        """One closed-loop pass; the same summary as an HTTP side's ``load.run_pass``."""
        assert self.proc is not None and self.proc.stdin is not None
        q = {"prompts": prompts, "concurrency": concurrency, "max_tokens": max_tokens}
        try:
            self.proc.stdin.write(json.dumps(q).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it ended: _read says why
        try:
            out = json.loads(self._read("RESULT ", None))
        except BenchError as exc:
            raise BenchError(f"the engine alone failed: {exc}") from None
        return summarise(out["results"], out["wall_s"])

    def _read(self, prefix: str, timeout: float | None) -> str:
        """The rest of the first stdout line that starts with ``prefix``."""
        assert self.proc is not None and self.proc.stdout is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        while (line := self._line(deadline)) is not None:
            if line.startswith(prefix):
                return line[len(prefix) :]
        if self.proc.poll() is None:
            raise BenchError(f"not ready after {timeout:.0f} s" + self._tail())
        raise BenchError(f"exited with status {self.proc.wait()}" + self._tail())

    def _line(self, deadline: float | None) -> str | None:
        """The next stdout line; None at its end or once ``deadline`` (monotonic) passed."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            if not select.select([fd], [], [], left)[0]:
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode(errors="replace")

    def _tail(self, lines: int = 8) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return "; the last lines of its log:\n" + "\n".join(text) if text else ""

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM (it holds nothing to save), SIGKILL to its group if it outlives ``grace``."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
