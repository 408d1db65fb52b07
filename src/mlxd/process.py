"""Pid files and process identity for ``mlxd start | status | stop``.

One server per port: ``$MLXD_HOME/run/mlxd-<port>.pid`` (JSON) and its log,
``$MLXD_HOME/logs/mlxd-<port>.log``. The server writes its own pid file when it starts
(``mlxd serve``, ``mlxd start``, a systemd or launchd service alike) and removes it when it
exits; ``mlxd start`` refuses a port whose pid file names a live mlxd.

A pid file is stale when its process is gone, is a zombie, or the pid now belongs to
another program (pid reuse): the file records the process's start time (from
``/proc/<pid>/stat`` on Linux, ``ps -o lstart`` elsewhere) and the process's command line
must still mention mlxd. Stale files are removed by whoever finds them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mlxd.config import mlxd_home


def run_dir() -> Path:
    return mlxd_home() / "run"


def logs_dir() -> Path:
    return mlxd_home() / "logs"


def pid_path(port: int) -> Path:
    return run_dir() / f"mlxd-{port}.pid"


def log_path(port: int) -> Path:
    return logs_dir() / f"mlxd-{port}.log"


@dataclass
class PidInfo:
    pid: int
    port: int
    host: str = "127.0.0.1"
    started_at: float = 0.0  # time.time()
    proc_start: str | None = None  # the OS's start time of the process, for pid reuse
    shutdown_grace_s: float = 30.0
    log: str | None = None
    argv: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return base_url(self.host, self.port)


def base_url(host: str, port: int) -> str:
    h = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://{'[' + h + ']' if ':' in h else h}:{port}"


# -- process identity ------------------------------------------------------------------------


def _linux_stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ..." - comm may hold spaces and parentheses
    return raw[raw.rfind(")") + 2 :].split()


def proc_start(pid: int) -> str | None:
    """An opaque, stable start time of ``pid``; None when unknown."""
    st = _linux_stat(pid)
    if st is not None:
        return st[19] if len(st) > 19 else None  # field 22: starttime in clock ticks
    if sys.platform.startswith("linux"):
        return None
    try:
        out = subprocess.run(
            ["ps", "-o", "lstart=", "-p", str(pid)], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def proc_cmdline(pid: int) -> str | None:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        pass
    if sys.platform.startswith("linux"):
        return None
    try:
        out = subprocess.run(
            ["ps", "-o", "command=", "-p", str(pid)], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def open_pidfd(pid: int) -> int | None:
    """A descriptor that turns readable the moment ``pid`` exits (Linux's ``pidfd_open``,
    a zombie included), for an event loop to watch instead of polling ``/proc``. None where
    there is none (macOS, kernels before 5.3) or the process is already gone."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return opener(pid)
    except OSError:
        return None


def pid_alive(pid: int) -> bool:
    """Exists and is not a zombie (an exited child nobody reaped yet is not running)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, someone else's
    st = _linux_stat(pid)
    if st is not None:
        return st[0] not in ("Z", "X")
    if not sys.platform.startswith("linux"):
        try:
            out = subprocess.run(
                ["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True, timeout=5
            )
            return bool(out.stdout.strip()) and not out.stdout.strip().startswith("Z")
        except (OSError, subprocess.SubprocessError):
            return True
    return True


def is_our_process(info: PidInfo) -> bool:
    """The pid file's process is alive and is that very mlxd (not a reused pid)."""
    if not pid_alive(info.pid):
        return False
    if info.proc_start is not None:
        now = proc_start(info.pid)
        if now is not None and now != info.proc_start:
            return False
    cmd = proc_cmdline(info.pid)
    return cmd is None or "mlxd" in cmd


# -- pid files -------------------------------------------------------------------------------


def read_pidfile(path: Path) -> PidInfo | None:
    try:
        data = json.loads(path.read_text())
        return PidInfo(**{k: v for k, v in data.items() if k in PidInfo.__dataclass_fields__})
    except (OSError, ValueError, TypeError):
        return None


def write_pidfile(
    port: int, host: str, *, shutdown_grace_s: float = 30.0, log: str | None = None
) -> Path:
    """This process's pid file, written atomically (temp file + rename)."""
    path = pid_path(port)
    path.parent.mkdir(parents=True, exist_ok=True)
    info = PidInfo(
        pid=os.getpid(),
        port=port,
        host=host,
        started_at=time.time(),
        proc_start=proc_start(os.getpid()),
        shutdown_grace_s=shutdown_grace_s,
        log=log,
        argv=list(sys.argv),
    )
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(info), indent=2) + "\n")
    os.replace(tmp, path)
    return path


def remove_pidfile(port: int, pid: int | None = None) -> None:
    """Remove the port's pid file; with ``pid``, only if it is still that process's."""
    path = pid_path(port)
    if pid is not None:
        info = read_pidfile(path)
        if info is not None and info.pid != pid:
            return
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


@dataclass
class Found:
    info: PidInfo | None  # the live server, or None
    stale: PidInfo | None = None  # a pid file that was removed as stale
    path: Path | None = None


def find(port: int, *, clean: bool = True) -> Found:
    """The live mlxd on ``port`` per its pid file; a stale file is removed (``clean``)."""
    path = pid_path(port)
    if not path.exists():
        return Found(None, path=path)
    info = read_pidfile(path)
    if info is not None and is_our_process(info):
        return Found(info, path=path)
    if clean:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return Found(None, stale=info or PidInfo(pid=-1, port=port), path=path)


def all_ports() -> list[int]:
    out = []
    for p in sorted(run_dir().glob("mlxd-*.pid")):
        with contextlib.suppress(ValueError):
            out.append(int(p.stem.removeprefix("mlxd-")))
    return out


def port_in_use(host: str, port: int) -> bool:
    """True when binding ``host:port`` fails (another program listens there)."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError:
        return False  # let the server report an unresolvable host itself
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            s.bind(addr)
        except OSError:
            return True
    return False


def terminate(pid: int, sig: int = signal.SIGTERM) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def wait_gone(pid: int, timeout: float, every: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(every)
    return True


def tail(path: Path | str | None, lines: int = 30) -> str:
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(size - 64 * 1024, 0))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])
