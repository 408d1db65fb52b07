"""The graceful drain every front end runs before it exits (one front end, or each of N).

On the first SIGTERM/SIGINT, or when the process that supervises several front ends says
so (workers.py): stop admitting (every new request gets 503 while
the listening socket stays open, ``/health`` says "draining"), wait up to
``server.shutdown_grace_s`` for the requests in flight, then end what still runs with an
error in its dialect (a stream gets an error event, then its end) and exit. A second
signal skips the rest of the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn

log = logging.getLogger(__name__)

# After the grace: how long the requests that were cut get to write their error and end
# before uvicorn's own shutdown (which cancels what is left) takes over.
CUT_WAIT_S = 5.0


class DrainingServer(uvicorn.Server):
    """uvicorn's Server with a drain phase before its own shutdown.

    ``app``: the FastAPI app (its ``state.lifecycle`` and ``state.runtime``); it may be set
    after construction, before the server starts. ``drain_when``: blocks (on a thread of
    its own) until the drain should start as a first signal would start it (a front end
    among several: its supervisor says when)."""

    def __init__(
        self,
        config: uvicorn.Config,
        app: Any,
        grace: float,
        on_exit: Callable[[], None] | None = None,
        drain_when: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.app = app
        self.grace = grace
        self.on_exit = on_exit
        self.drain_when = drain_when
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_started = False
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        if self.drain_when is not None:
            threading.Thread(target=self._await_drain, daemon=True, name="mlxd-drain-when").start()
        with self.capture_signals():
            try:
                await self._serve(sockets)
            finally:
                # before capture_signals re-raises the signal (which ends the process)
                if self.on_exit is not None:
                    self.on_exit()

    def handle_exit(self, sig: int, frame: Any) -> None:
        if (
            not self._drain_started
            and self.started
            and not self.should_exit
            and self._loop is not None
            and self.grace > 0
        ):
            self._drain_started = True
            self._loop.call_soon_threadsafe(self._begin_drain, sig)
            return
        super().handle_exit(sig, frame)  # a second signal, or not serving yet: uvicorn's way

    def _await_drain(self) -> None:
        assert self.drain_when is not None
        self.drain_when()
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to drain
                loop.call_soon_threadsafe(self._drain_requested)

    def _drain_requested(self) -> None:
        """The supervisor's drain: a first signal's, never a second one's (a signal sent to
        the whole process group reaches this front end too)."""
        if self._drain_started or self.should_exit:
            return
        if not self.started or self.grace <= 0:
            self.should_exit = True
            return
        self._drain_started = True
        self._begin_drain(None)

    def _begin_drain(self, sig: int | None) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self.drain(sig))

    async def drain(self, sig: int | None = None) -> None:
        state = self.app.state
        lifecycle, runtime = state.lifecycle, state.runtime
        lifecycle.draining = True
        runtime.draining = True
        log.info(
            "shutting down: new requests get 503; waiting up to %.0fs for %d in flight",
            self.grace,
            lifecycle.inflight,
        )
        deadline = time.monotonic() + self.grace
        await self._wait_idle(lifecycle, deadline)
        if self.should_exit:  # a second signal already ended the wait
            return
        if lifecycle.inflight > 0:
            log.warning(
                "grace period (server.shutdown_grace_s=%.0f) over: ending %d "
                "request(s) with an error",
                self.grace,
                lifecycle.inflight,
            )
            runtime.cut_streams()
            await self._wait_idle(lifecycle, time.monotonic() + CUT_WAIT_S)
        else:
            log.info("all requests finished")
        if self.should_exit:
            return
        if sig is not None:
            super().handle_exit(sig, None)  # uvicorn re-raises it at exit: status says so
        else:
            self.should_exit = True

    async def _wait_idle(self, lifecycle: Any, deadline: float) -> None:
        while lifecycle.inflight > 0 and time.monotonic() < deadline and not self.should_exit:
            await asyncio.sleep(0.05)
