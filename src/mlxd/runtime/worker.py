"""The one thread that runs MLX for this device.

MLX streams are not meant to be shared across threads, and a forward pass must never run
on the event loop, so every load, prefill and decode step happens here. The loop drains
commands (add, cancel, call) between steps, which is what lets new requests join the
running batch and lets a cancelled request leave it at the next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

log = logging.getLogger(__name__)


class Engine:  # structural protocol the worker relies on
    """What the worker needs of an engine.

    ``has_work()`` is True when a step would do something now. An engine that batches
    across callers (wait a few ms for more requests) may also define ``next_deadline()``:
    the ``time.monotonic()`` at which it wants a step even if no command arrives.
    """

    name: str

    def add(self, seq: Any) -> None: ...
    def cancel(self, seq: Any) -> None: ...
    def has_work(self) -> bool: ...
    def step(self) -> list: ...
    def fail_all(self, exc: Exception) -> list: ...


Delivery = tuple[asyncio.AbstractEventLoop, asyncio.Queue]


class DeviceWorker:
    def __init__(self, name: str = "mlxd-device") -> None:
        self._name = name
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._engines: list[Any] = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._stopping = False
        self.error = None
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._cmds.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # -- commands (any thread) -------------------------------------------------------------
    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the worker between steps; the Future carries its result."""
        fut: Future = Future()
        if not self.alive:
            fut.set_exception(RuntimeError("device worker is not running"))
            return fut
        self._cmds.put(("call", fn, fut))
        return fut

    def attach(self, engine: Any) -> None:
        self._cmds.put(("attach", engine))

    def detach(self, engine: Any) -> None:
        self._cmds.put(("detach", engine))

    def submit(self, engine: Any, seq: Any) -> None:
        self._cmds.put(("add", engine, seq))

    def cancel(self, engine: Any, seq: Any) -> None:
        self._cmds.put(("cancel", engine, seq))

    # -- the loop --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                busy = [e for e in self._engines if e.has_work()]
                self._drain(block=not busy, timeout=None if busy else self._until_deadline())
                for engine in busy:
                    if engine in self._engines and engine.has_work():
                        self._step(engine)
        except BaseException as exc:  # noqa: BLE001 - recorded so /health can tell the truth
            self.error = exc
            log.exception("device worker died")
            raise

    def _until_deadline(self) -> float | None:
        """Seconds until the earliest engine deadline, or None to sleep until a command."""
        deadlines = [d for e in self._engines
                     if (d := getattr(e, "next_deadline", lambda: None)()) is not None]
        if not deadlines:
            return None
        return max(min(deadlines) - time.monotonic(), 0.0)

    def _drain(self, block: bool, timeout: float | None = None) -> None:
        try:
            cmd = self._cmds.get(block=block, timeout=timeout if block else 0)
        except queue.Empty:
            return
        while True:
            self._exec(cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _exec(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, engine, seq = cmd
            try:
                engine.add(seq)
            except Exception as exc:  # noqa: BLE001 - the request fails, the worker lives
                from mlxd.core.types import TokenEvent

                _deliver([(seq, TokenEvent(text="", finish_reason="error", error=exc))])
        elif kind == "cancel":
            _, engine, seq = cmd
            engine.cancel(seq)
        elif kind == "call":
            _, fn, fut = cmd
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001
                    fut.set_exception(exc)
        elif kind == "attach":
            if cmd[1] not in self._engines:
                self._engines.append(cmd[1])
        elif kind == "detach":
            if cmd[1] in self._engines:
                self._engines.remove(cmd[1])

    def _step(self, engine: Any) -> None:
        try:
            events = engine.step()
        except Exception as exc:  # noqa: BLE001 - e.g. an allocation failure mid-batch
            log.exception("engine %s failed a step; failing its batch", engine.name)
            events = engine.fail_all(exc)
        if events:
            _deliver(events)


def _deliver(events: list) -> None:
    """Hand events to their event loops: one thread-safe hop per loop per step, not per token."""
    by_loop: dict[Any, list] = defaultdict(list)
    for seq, event in events:
        loop, q = seq.handle
        by_loop[loop].append((q, event))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the loop is closed: its requests are gone anyway
            pass


def _put_all(items: list) -> None:
    for q, event in items:
        q.put_nowait(event)
