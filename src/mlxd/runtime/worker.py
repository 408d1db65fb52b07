"""The one thread that runs MLX for this device.

MLX streams are not meant to be shared across threads, and a forward pass must never run
on the event loop, so every load, prefill and decode step happens here. The loop drains
commands (add, cancel, call) between steps, which is what lets new requests join the
running batch and lets a cancelled request leave it at the next step.

Failure, in two sizes:

* An engine step that raises (an allocation failure mid-batch, say) fails that engine's
  batch and nothing else: the worker lives on. :func:`is_out_of_memory` tells the runtime
  which errors to report as 503 "out of memory" instead of 500.
* The thread itself dying (an exception outside any step) fails everything it held: the
  sequences of every attached engine, queued commands and calls, all with
  :class:`WorkerDied`; from then on ``alive`` is False (``/health`` says 503) and every new
  command fails at once instead of waiting forever. The engine core then exits
  (enginecore/core.py) and its supervisor starts a fresh process: MLX state of a dead
  thread is not to be trusted, so nothing is restarted in-process.
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


class LoopChannel:
    """Delivers to asyncio queues of one event loop: one thread-safe hop per step.

    A sequence's or job's ``handle`` is ``(channel, key)``; the worker groups a step's
    events by channel and hands each channel its list of ``(key, event)`` at once.
    """

    __slots__ = ("loop",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def send(self, items: list) -> None:
        try:
            self.loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the loop is closed: its requests are gone anyway
            pass


_OOM_MARKERS = (
    "[metal::malloc]",
    "[malloc]",
    "attempting to allocate",
    "out of memory",
    "outofmemory",
    "cudaerrormemoryallocation",
    "cuda_error_out_of_memory",
    "failed to allocate",
    "insufficient memory",
    "kiogpucommandbuffercallbackerroroutofmemory",
)


def is_out_of_memory(exc: BaseException) -> bool:
    """A MemoryError, or an MLX/Metal/CUDA allocation failure (they arrive as RuntimeError)."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower().replace(" ", "")
    return any(m.replace(" ", "") in text for m in _OOM_MARKERS)


class WorkerDied(RuntimeError):
    """The device worker thread died; what it was doing is lost (a restart follows)."""


class DeviceWorker:
    def __init__(self, name: str = "mlxd-device") -> None:
        self._name = name
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._engines: list[Any] = []
        self._thread: threading.Thread | None = None
        self._stopping = False
        # Guards _dead against commands racing the thread's death: a command put after the
        # death handler drained the queue would wait forever.
        self._lock = threading.Lock()
        self._dead = False
        self.error: BaseException | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            self._stopping = False
            self._dead = False
            self.error = None
            self._cmds = queue.SimpleQueue()
            self._engines = []
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._cmds.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return (
            self._thread is not None
            and self._thread.is_alive()
            and not self._stopping
            and not self._dead
        )

    @property
    def dead(self) -> bool:
        """The thread died on its own (not stopped): the engine core exits."""
        return (
            self._thread is not None
            and not self._stopping
            and (self._dead or not self._thread.is_alive())
        )

    def inject_fault(self, exc: BaseException) -> None:
        """Make the worker thread die with ``exc`` (tests and failure drills)."""
        self._put(("raise", exc))

    # -- commands (any thread) -------------------------------------------------------------
    def _put(self, cmd: tuple) -> bool:
        """Queue ``cmd`` unless the worker is dead; False when it was not queued."""
        with self._lock:
            if self._dead or self._thread is None:
                return False
            self._cmds.put(cmd)
            return True

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the worker between steps; the Future carries its result."""
        fut: Future = Future()
        if not self.alive or not self._put(("call", fn, fut)):
            fut.set_exception(WorkerDied("device worker is not running"))
        return fut

    def attach(self, engine: Any) -> None:
        self._put(("attach", engine))

    def detach(self, engine: Any) -> None:
        self._put(("detach", engine))

    def submit(self, engine: Any, seq: Any) -> None:
        if not self._put(("add", engine, seq)):
            _deliver([(seq, _error_event(WorkerDied("device worker is not running")))])

    def cancel(self, engine: Any, seq: Any) -> None:
        self._put(("cancel", engine, seq))

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
            log.critical("device worker died: %s: %s", type(exc).__name__, exc, exc_info=exc)
            self._fail_everything(exc)

    def _fail_everything(self, exc: BaseException) -> None:
        """On the dying thread: nobody may wait forever for an answer from it."""
        with self._lock:
            self._dead = True
        died = WorkerDied(f"the device worker failed ({type(exc).__name__}: {exc})")
        for engine in list(self._engines):
            try:
                events = engine.fail_all(died)
            except BaseException:  # noqa: BLE001 - best effort, the thread is going anyway
                log.exception("engine %s could not fail its batch", engine.name)
                continue
            if events:
                _deliver(events)
        self._engines = []
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                _deliver([(cmd[2], _error_event(died))])
            elif cmd[0] == "call" and cmd[2].set_running_or_notify_cancel():
                cmd[2].set_exception(died)

    def _until_deadline(self) -> float | None:
        """Seconds until the earliest engine deadline, or None to sleep until a command."""
        deadlines = [
            d
            for e in self._engines
            if (d := getattr(e, "next_deadline", lambda: None)()) is not None
        ]
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
                _deliver([(seq, _error_event(exc))])
        elif kind == "cancel":
            _, engine, seq = cmd
            try:
                engine.cancel(seq)
            except Exception:  # noqa: BLE001 - a failed cancel must not kill the worker
                log.exception("engine %s failed to cancel a sequence", engine.name)
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
        elif kind == "raise":
            raise cmd[1]

    def _step(self, engine: Any) -> None:
        try:
            events = engine.step()
        except Exception as exc:  # noqa: BLE001 - e.g. an allocation failure mid-batch
            log.exception("engine %s failed a step; failing its batch", engine.name)
            events = engine.fail_all(exc)
        if events:
            _deliver(events)


def _error_event(exc: BaseException) -> Any:
    from mlxd.engines.decode import StepOutput

    return StepOutput(None, "error", error=exc)  # type: ignore[arg-type]


def _deliver(events: list) -> None:
    """Hand a step's events to their channels: one hop per channel per step, not per token."""
    by_channel: dict[Any, list] = defaultdict(list)
    for seq, event in events:
        if seq.handle is None:  # warm-up sequences
            continue
        channel, key = seq.handle
        by_channel[channel].append((key, event))
    for channel, items in by_channel.items():
        channel.send(items)


def _put_all(items: list) -> None:
    for q, event in items:
        q.put_nowait(event)
