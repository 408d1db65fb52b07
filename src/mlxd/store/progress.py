"""The progress callback every store operation takes, in a module of its own.

Sources, the store and the pull/quantize operations all report through the same callback
type; defining it here (importing nothing from mlxd) lets each of them use it without
importing one another, which is how ``pull`` and ``sources`` used to end up in a circle.
``ProgressLog`` turns the same events into throttled log lines for the server log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["ProgressFn", "ProgressLog", "emitter", "human_bytes", "noop", "tee"]

# Receives Ollama /api/pull-style events: {"status": ..., "total": ..., "completed": ...}
ProgressFn = Callable[[dict], None]


def noop(_event: dict) -> None:
    """The callback used when the caller passed none."""


def emitter(progress: ProgressFn | None) -> ProgressFn:
    """``progress`` or, when None, a callback that drops every event."""
    return progress if progress is not None else noop


def human_bytes(n: float) -> str:
    """1234567 -> '1.2 MB' (decimal units, as download tools show them)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def tee(*callbacks: ProgressFn) -> ProgressFn:
    """One callback that hands each event to all of ``callbacks`` in order."""

    def emit(event: dict) -> None:
        for cb in callbacks:
            cb(event)

    return emit


class ProgressLog:
    """A progress callback that writes log lines a server operator can follow.

    Downloads and imports emit byte events up to ten times a second; logging each would
    bury the log, so a transfer is logged when it starts, then at most every ``interval``
    seconds, then once when it completes, with bytes done, total, percentage and rate.
    Status-only events (steps in between) are logged as they come: there are few.
    """

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        *,
        interval: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger, self.what, self.interval, self.clock = logger, what, interval, clock
        self._key: tuple[str, str] | None = None
        self._start = self._last = 0.0
        self._start_bytes = 0
        self._done = False

    def __call__(self, event: dict) -> None:
        status = str(event.get("status", ""))
        total, completed = event.get("total"), event.get("completed")
        if not total or completed is None:
            self.logger.info("%s: %s", self.what, status)
            return
        now = self.clock()
        key = (status, str(event.get("digest", "")))
        if key != self._key:  # a new transfer
            self._key, self._start, self._start_bytes, self._done = key, now, completed, False
        elif self._done or (completed < total and now - self._last < self.interval):
            return
        self._last = now
        self._done = completed >= total
        elapsed = now - self._start
        rate = (completed - self._start_bytes) / elapsed if elapsed > 0 else 0.0
        self.logger.info(
            "%s: %s %s / %s (%.0f%%, %s/s)",
            self.what,
            status,
            human_bytes(completed),
            human_bytes(total),
            100 * completed / total,
            human_bytes(rate),
        )
