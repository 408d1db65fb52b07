"""A front end's connection to the engine core: streams, calls, and noticing a death.

One reader task routes the core's messages: per-step :class:`~mlxd.enginecore.protocol.
Outputs` to each request's queue, replies to their calls. The core is declared dead when
its process exits (on Linux the event loop watches a pidfd of it, so that is at once;
elsewhere a watchdog polls every 50 ms) or its heartbeat has been silent for
``dead_after`` seconds; then every request in flight ends with a 503 (a stream with an
error event), and :meth:`CoreClient.wait_ready` holds new work until the next core says
it is ready."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from mlxd.core.errors import Unavailable
from mlxd.enginecore import protocol as p
from mlxd.process import open_pidfd, pid_alive

log = logging.getLogger(__name__)


def _died() -> p.WireError:
    return p.WireError("core_died", "the engine core stopped")


class CoreClient:
    """One engine core's connection (frontend/cores.py's CorePool holds one per device)."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        dead_after: float = 3.0,
        index: int = 0,
        device: str | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.index = index  # among this host's engine cores
        self.device = device  # as the supervisor placed it (None: ask the core's status)
        self.frontend = p.frontend_id(os.getpid(), next(_instances))
        self.address = f"ipc://{self.run_dir / f'fe-{self.frontend}'}"
        self.dead_after = dead_after
        self.epoch = 0  # of the core we talk to; 0: none yet
        self.core_pid: int | None = None
        self.alive = False
        self.ready = False
        self.startup_error: str | None = None
        self.deaths = 0
        self._last_beat = 0.0
        self.core_load = 0  # the core's requests in flight, all front ends', per heartbeat
        self.core_limit = 0  # the requests the core admits, per heartbeat (0: not heard yet)
        self._streams: dict[str, asyncio.Queue] = {}
        self._orphans: list[str] = []  # failed on a stall; aborted if the same core returns
        self._calls: dict[int, asyncio.Future[p.Reply]] = {}
        self._cid = itertools.count(1)
        self._ready_event = asyncio.Event()
        self._enc = p.encoder()
        self._tasks: list[asyncio.Task] = []
        self._ctx: zmq.asyncio.Context | None = None
        self._push: zmq.Socket[bytes]
        self._pull: zmq.asyncio.Socket
        self._pidfd: int | None = None  # the core's process, watched by the event loop

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        # Sending never waits (no high-water mark, NOBLOCK), so the push socket is a plain
        # one on the same context: an asyncio socket's send makes a Future per message.
        self._push = zmq.Context.shadow(self._ctx.underlying).socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.connect(p.core_address(self.run_dir))
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(self.address)
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]

    async def close(self) -> None:
        if self._ctx is None:
            return
        with contextlib.suppress(Exception):
            self._send(p.Bye(self.frontend))
        for t in self._tasks:
            t.cancel()
        self._unwatch_pid()
        self._fail_all(_died())
        await asyncio.sleep(0)
        self._push.close(0)
        self._pull.close(0)
        self._ctx.term()
        self._ctx = None

    @property
    def started(self) -> bool:
        return self._ctx is not None

    @property
    def serving(self) -> bool:
        return self.alive and self.ready

    @property
    def load(self) -> int:
        """How busy the core is, for routing: its last heartbeat's count (every front
        end's requests, up to 200 ms old) or this front end's own streams and calls there
        (exact, so a burst spreads before the next heartbeat), whichever is larger."""
        return max(self.core_load, len(self._streams) + len(self._calls))

    # -- sending -----------------------------------------------------------------------------
    def _send(self, msg: Any) -> None:
        self._push.send(self._enc.encode(msg), zmq.NOBLOCK)

    async def wait_ready(self, timeout: float) -> None:
        if self.alive and self.ready:
            return
        try:
            await asyncio.wait_for(self._ready_event.wait(), timeout)
        except asyncio.TimeoutError:
            raise Unavailable(
                "the engine core is not running (restarting); retry shortly",
                headers={"Retry-After": "2"},
            ) from None

    def open_stream(self, rid: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = q
        return q

    def close_stream(self, rid: str, *, abort: bool) -> None:
        if self._streams.pop(rid, None) is not None and abort and self.alive:
            with contextlib.suppress(zmq.ZMQError):
                self._send(p.Abort(self.epoch, [rid]))

    def add(self, msg: p.Add) -> None:
        msg.epoch, msg.frontend = self.epoch, self.frontend
        self._send(msg)

    async def call(self, request: p.Request[p.R]) -> p.R:
        """One call (its result's type is the request's: ``call(p.Unload(...))`` answers
        :class:`~mlxd.enginecore.protocol.Unloaded`); cancelling the caller (a client gone)
        cancels it in the core."""
        if not self.alive:
            raise p.error_from_wire(_died())
        cid = next(self._cid)
        fut: asyncio.Future[p.Reply] = asyncio.get_running_loop().create_future()
        self._calls[cid] = fut
        self._send(p.Call(self.epoch, self.frontend, cid, request))  # type: ignore[arg-type]
        try:
            reply = await fut
        except asyncio.CancelledError:
            if self.alive:
                with contextlib.suppress(zmq.ZMQError):
                    self._send(p.CancelCall(self.epoch, self.frontend, cid))
            raise
        finally:
            self._calls.pop(cid, None)
        if reply.error is not None:
            raise p.error_from_wire(reply.error)
        expected = p.result_type(request)
        if not isinstance(reply.value, expected):
            raise p.error_from_wire(
                p.WireError(
                    "engine",
                    f"the engine core answered {type(reply.value).__name__} to "
                    f"{type(request).__name__}, not {expected.__name__}",
                )
            )
        return reply.value

    # -- receiving ---------------------------------------------------------------------------
    async def _read(self) -> None:
        decode = p.frontend_decoder().decode
        while True:
            raw = await self._pull.recv()
            try:
                msg = decode(raw)
            except Exception as exc:  # noqa: BLE001 - a malformed message must not stop it
                msg = self._undecodable(raw, exc)
                if msg is None:
                    continue
            if isinstance(msg, p.Heartbeat):
                self._beat(msg)
            elif msg.epoch != self.epoch:
                continue
            elif isinstance(msg, p.Outputs):
                streams = self._streams
                for out in msg.outputs:
                    q = streams.get(out.rid)
                    if q is not None:
                        q.put_nowait(out)
            elif isinstance(msg, p.Reply):
                fut = self._calls.get(msg.cid)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    def _undecodable(self, raw: bytes, exc: Exception) -> p.Reply | None:
        """A message that does not decode: a reply fails its call (500) rather than leave
        it waiting; anything else is dropped."""
        head = p.reply_head(raw)
        if head is None:
            log.error("dropped an undecodable message from the engine core: %s", exc)
            return None
        log.error("an undecodable reply from the engine core: %s", exc)
        return p.Reply(
            head.epoch, head.cid, None, p.WireError("engine", f"undecodable reply: {exc}")
        )

    def _beat(self, hb: p.Heartbeat) -> None:
        self._last_beat = time.monotonic()
        if hb.epoch != self.epoch:
            if self.alive:  # a new core without us noticing the old one's death
                self._declare_dead()
            self.epoch, self.core_pid, self.alive = hb.epoch, hb.pid, True
            self._orphans = []
            self._watch_pid(hb.pid)
            log.info("connected to engine core %d (epoch %d, pid %d)", self.index, hb.epoch, hb.pid)
        elif not self.alive:
            # The same core, silent for a while (a stall: swap, a starved CPU) and back.
            # What we failed when we gave up on it may still run there: abort it, then
            # serve again. A core that really died never sends this.
            self.alive = True
            if self._orphans:
                with contextlib.suppress(zmq.ZMQError):
                    self._send(p.Abort(self.epoch, self._orphans))
            log.warning(
                "engine core %d (pid %d) answers again after a stall; %d request(s) "
                "failed meanwhile",
                hb.epoch,
                hb.pid,
                len(self._orphans),
            )
            self._orphans = []
        self.ready = hb.ready
        self.startup_error = hb.error
        self.core_load = hb.load
        self.core_limit = hb.limit
        if hb.ready:
            self._ready_event.set()

    async def _watch(self, every: float = 0.05) -> None:
        last_hello = 0.0
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            if self.alive and (
                now - self._last_beat > self.dead_after
                or (
                    self._pidfd is None
                    and self.core_pid is not None
                    and not pid_alive(self.core_pid)
                )
            ):
                self._declare_dead()
            if not self.alive and now - last_hello > 0.2:
                last_hello = now  # until a core answers (ZeroMQ reconnects the socket)
                with contextlib.suppress(zmq.ZMQError):
                    self._send(p.Hello(self.frontend, self.address))

    def _watch_pid(self, pid: int) -> None:
        self._unwatch_pid()
        fd = open_pidfd(pid)
        if fd is None:
            return
        try:
            asyncio.get_running_loop().add_reader(fd, self._pid_exited, pid)
        except OSError:  # the loop cannot watch it: the watchdog polls
            os.close(fd)
            return
        self._pidfd = fd

    def _unwatch_pid(self) -> None:
        fd, self._pidfd = self._pidfd, None
        if fd is None:
            return
        asyncio.get_running_loop().remove_reader(fd)  # always on the loop that added it
        os.close(fd)

    def _pid_exited(self, pid: int) -> None:
        self._unwatch_pid()
        if self.alive and self.core_pid == pid:
            self._declare_dead()

    def _declare_dead(self) -> None:
        log.error(
            "engine core %d (epoch %d, pid %s) is gone or stalled; failing %d request(s) in flight",
            self.index,
            self.epoch,
            self.core_pid,
            len(self._streams),
        )
        self._orphans = list(self._streams)
        self.alive = self.ready = False
        self.deaths += 1
        self._ready_event = asyncio.Event()
        self._fail_all(_died())

    def cut(self, err: p.WireError) -> int:
        """End every stream and call of this front end here with ``err`` (the server's
        shutdown grace ran out) and have the core drop the streams. Returns how many."""
        rids = list(self._streams)
        n = len(rids) + sum(not f.done() for f in self._calls.values())
        if rids and self.alive:
            with contextlib.suppress(zmq.ZMQError):
                self._send(p.Abort(self.epoch, rids))
        self._fail_all(err)
        return n

    def _fail_all(self, err: p.WireError) -> None:
        for rid, q in list(self._streams.items()):
            q.put_nowait(p.SeqOut(rid, [], "error", error=err, accepted=True))
        self._streams.clear()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_result(p.Reply(self.epoch, 0, None, err))


_instances = itertools.count()
