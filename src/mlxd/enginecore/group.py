"""A tensor- or pipeline-parallel engine core: N rank processes that live and die together.

``engine.tensor_parallel: N`` (``mlxd serve --tensor-parallel N``) or
``engine.pipeline_parallel: N`` (``--pipeline-parallel N``) makes the engine core a group of
N processes joined by MLX's own distributed runtime, set up the way ``mlx.launch`` sets it
up (environment variables read by ``mx.distributed.init``):

* ring (TCP; any machine): ``MLX_RANK`` and ``MLX_HOSTFILE``, a JSON list with one list
  of ``"ip:port"`` per rank (loopback on one host);
* nccl (NVIDIA): ``MLX_RANK``, ``MLX_WORLD_SIZE``, ``NCCL_HOST_IP``, ``NCCL_PORT``, and one
  GPU per rank through ``CUDA_VISIBLE_DEVICES``.

Both modes use the same group and the same replay; only how a model is split differs
(engines/tensor_parallel.py). MPI is not a backend here: MLX's forms a group only from a
world that ``mpirun`` started, and this module starts (and restarts) each rank itself.

Rank 0 is the ordinary engine core (``python -m mlxd.enginecore``): it talks to the front
ends and schedules. Ranks 1..N-1 are followers (``python -m mlxd.enginecore.follower``)
that replay rank 0's batch commands (engines/tensor_parallel.py) received over a ZeroMQ
PUSH -> PULL pipe, one per follower (reliable and in order, unlike PUB/SUB, which drops
what is sent before a subscriber has joined).

A rank that dies leaves the others blocked in a collective, so :class:`RankGroup` ends
every rank (SIGKILL: a process blocked in a collective runs no signal handler) as soon as
one is gone; the front ends see rank 0 gone and fail its requests with 503, and the
supervisor starts a new group, which loads the pinned model again.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from mlxd.backend_env import core_env
from mlxd.config import Settings, rank_hosts

log = logging.getLogger(__name__)

RANK_PIDS_ENV = "MLXD_TP_RANK_PIDS"  # rank 0 learns its followers' pids (for status)


def group_size(settings: Settings) -> int:
    return settings.engine.rank_group_size


_has_cuda: list[bool] = []  # asked once per process


def backend(settings: Settings) -> str:
    b = settings.engine.distributed.backend
    if b != "auto":
        return b
    if not _has_cuda:
        # asked in a child: importing mlx here would put MLX state into the serving process
        out = subprocess.run(
            [sys.executable, "-c", "import mlx.core as mx; print(int(mx.cuda.is_available()))"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        _has_cuda.append(out.stdout.strip() == "1")
    return "nccl" if _has_cuda[0] else "ring"


def _gpu(local: int, env: dict[str, str]) -> str:
    """The GPU of a host's ``local``-th rank: the local-th of those the server may use
    (CUDA_VISIBLE_DEVICES, when the operator narrowed them), else GPU ``local``."""
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return visible[local] if local < len(visible) else str(local)


def command_address(
    run_dir: Path, epoch: int, rank: int, host: str | None = None, port: int = 0
) -> tuple[str, str]:
    """(where follower ``rank`` binds its command pipe, where rank 0 connects to it)."""
    if host is None:
        addr = f"ipc://{run_dir / f'tp-{epoch}-{rank}'}"
        return addr, addr
    return f"tcp://*:{port}", f"tcp://{host}:{port}"


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def _hosts(settings: Settings, n: int) -> list[dict[str, Any]]:
    """One entry per rank: ``{"ssh": host or None (this host), "ip": ...}``."""
    path = settings.engine.distributed.hosts
    if path is None:
        return [{"ssh": None, "ip": "127.0.0.1"} for _ in range(n)]
    return rank_hosts(path, n, f"engine.{settings.engine.parallel_mode}_parallel")


class RankGroup:
    """The group's processes, with the part of ``subprocess.Popen`` the supervisor uses
    (``pid`` is rank 0's, the one the front ends watch)."""

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self.procs = procs  # rank order
        self._lock = threading.Lock()
        self._ended = False

    @property
    def pid(self) -> int:
        return self.procs[0].pid

    def poll(self) -> int | None:
        for p in self.procs:
            code = p.poll()
            if code is not None:
                return code
        return None

    def wait(self, timeout: float | None = None) -> int:
        """Until one rank exits; then the others are killed. Its exit code."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self.poll()
            if code is not None:
                dead = next(i for i, p in enumerate(self.procs) if p.poll() is not None)
                with self._lock:
                    first, self._ended = not self._ended, True
                if first and any(p.poll() is None for p in self.procs):
                    log.error(
                        "rank %d (pid %d) of the group exited with code %s; ending the group",
                        dead,
                        self.procs[dead].pid,
                        code,
                    )
                self.kill()
                return code
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("rank group", timeout or 0)
            time.sleep(0.02)

    def terminate(self) -> None:
        self._ended = True  # a stop, not a death: nothing to report
        # followers first: rank 0 may be blocked in a collective with them
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                log.error("rank (pid %d) of the group did not die", p.pid)


def spawn(settings: Settings, run_dir: Path, epoch: int, env: dict[str, str]) -> RankGroup:
    """Start every rank of a new group: followers first, then rank 0 (told their pids)."""
    n = group_size(settings)
    be = backend(settings)
    hosts = _hosts(settings, n)
    dist = settings.engine.distributed
    ports = [dist.port + i for i in range(2 * n)] if dist.port else _free_ports(2 * n)
    # ranks on other hosts get only these (over ssh): the MLX switches travel with them
    common = {"MLX_WORLD_SIZE": str(n), "MLXD_TP_BACKEND": be, **core_env(settings.backend)}
    if be == "ring":
        hostfile = run_dir / f"hosts-{epoch}.json"
        hostfile.write_text(json.dumps([[f"{h['ip']}:{ports[i]}"] for i, h in enumerate(hosts)]))
        common["MLX_HOSTFILE"] = str(hostfile)
    else:
        common["NCCL_HOST_IP"] = hosts[0]["ip"]
        common["NCCL_PORT"] = str(ports[0])
    followers: list[subprocess.Popen] = []
    addresses = []
    for rank in range(1, n):
        h = hosts[rank]
        bind, connect = command_address(
            run_dir, epoch, rank, None if h["ssh"] is None else h["ip"], ports[n + rank]
        )
        addresses.append(connect)
        renv = {**common, "MLX_RANK": str(rank)}
        if be == "nccl":  # one GPU per rank, counted per host
            local = sum(1 for o in hosts[:rank] if o["ssh"] == h["ssh"])
            renv["CUDA_VISIBLE_DEVICES"] = _gpu(local, env if h["ssh"] is None else {})
        argv = [sys.executable, "-m", "mlxd.enginecore.follower", str(run_dir), str(epoch), bind]
        if h["ssh"] is None:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env={**env, **renv})
        else:
            proc = _ssh(h["ssh"], argv, renv, run_dir)
        followers.append(proc)
    renv = {
        **common,
        "MLX_RANK": "0",
        RANK_PIDS_ENV: ",".join(str(p.pid) for p in followers),
        "MLXD_TP_FOLLOWERS": json.dumps(addresses),
    }
    if be == "nccl":
        renv["CUDA_VISIBLE_DEVICES"] = _gpu(0, env)
    rank0 = subprocess.Popen(
        [sys.executable, "-m", "mlxd.enginecore", str(run_dir), str(epoch)],
        stdin=subprocess.DEVNULL,
        env={**env, **renv},
    )
    log.info(
        "%s-parallel engine core %d: %d ranks (%s), pids %s",
        settings.engine.parallel_mode,
        epoch,
        n,
        be,
        [rank0.pid, *(p.pid for p in followers)],
    )
    return RankGroup([rank0, *followers])


def _ssh(host: str, argv: list[str], renv: dict[str, str], run_dir: Path) -> subprocess.Popen:
    """A follower on another host, as mlx.launch starts one: over ssh, with the hostfile's
    content and the settings written there first (same interpreter path and run dir)."""
    script = f"mkdir -p {shlex.quote(str(run_dir))}; "
    hostfile = renv.get("MLX_HOSTFILE")
    if hostfile:
        content = Path(hostfile).read_text()
        script += f"printf %s {shlex.quote(content)} > {shlex.quote(hostfile)}; "
    settings_file = run_dir / "settings.pkl"
    script += (
        f"base64 -d > {shlex.quote(str(settings_file))} <<'EOF'\n"
        f"{_b64(settings_file.read_bytes())}\nEOF\n"
    )
    for k, v in renv.items():
        script += f"export {k}={shlex.quote(v)}; "
    script += "exec " + " ".join(shlex.quote(a) for a in argv)
    return subprocess.Popen(["ssh", "-o", "BatchMode=yes", host, script], stdin=subprocess.DEVNULL)


def _b64(data: bytes) -> str:
    import base64

    return base64.encodebytes(data).decode()


PING_S = 1.0  # rank 0 -> followers, so that a follower whose rank 0 is gone can tell
SILENCE_S = 15.0  # a follower that hears nothing for this long exits


class CommandLink:
    """Rank 0's end of the command pipes: encodes once, sends to every follower, in order
    (a lock: commands come from the device thread, loads from a loader thread)."""

    def __init__(self, addresses: list[str]) -> None:
        import msgspec
        import zmq

        self._enc = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context()
        self._socks = []
        for a in addresses:
            s = self._ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(a)
            self._socks.append(s)
        self._lock = threading.Lock()
        threading.Thread(target=self._pinger, name="mlxd-tp-ping", daemon=True).start()

    def send(self, cmd: tuple) -> None:
        raw = self._enc.encode(cmd)
        with self._lock:
            for s in self._socks:
                s.send(raw)

    def _pinger(self) -> None:
        while True:
            time.sleep(PING_S)
            self.send(("ping", 0))


def init_rank(settings: Settings) -> Any:
    """In a rank process, before any model: join the group (blocks until every rank has)."""
    import mlx.core as mx

    be = os.environ.get("MLXD_TP_BACKEND", "ring")
    t0 = time.monotonic()
    g = mx.distributed.init(strict=True, backend=be)
    log.info(
        "rank %d of %d joined the %s group in %.1fs", g.rank(), g.size(), be, time.monotonic() - t0
    )
    return g


def lead(settings: Settings) -> None:
    """Rank 0: join the group and install the command publisher for the engines."""
    from mlxd.engines import tensor_parallel

    link = CommandLink(json.loads(os.environ.get("MLXD_TP_FOLLOWERS", "[]")))
    tensor_parallel.setup(init_rank(settings), link.send, settings.engine.parallel_mode)


def status() -> dict[str, Any] | None:
    """For /health and ``mlxd ps``: the group this engine core leads, if any (its mode,
    size, backend and the ranks' pids in rank order)."""
    from mlxd.engines import tensor_parallel

    g = tensor_parallel.group()
    if g is None:
        return None
    pids = [os.getpid(), *(int(p) for p in os.environ.get(RANK_PIDS_ENV, "").split(",") if p)]
    return {
        "mode": tensor_parallel.mode(),
        "size": g.size(),
        "backend": os.environ.get("MLXD_TP_BACKEND", "ring"),
        "rank_pids": pids,
    }
