"""The progress callback every store operation takes, in a module of its own.

Sources, the store and the pull/quantize operations all report through the same callback
type; defining it here (importing nothing from mlxd) lets each of them use it without
importing one another, which is how ``pull`` and ``sources`` used to end up in a circle.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["ProgressFn", "emitter", "noop"]

# Receives Ollama /api/pull-style events: {"status": ..., "total": ..., "completed": ...}
ProgressFn = Callable[[dict], None]


def noop(_event: dict) -> None:
    """The callback used when the caller passed none."""


def emitter(progress: ProgressFn | None) -> ProgressFn:
    """``progress`` or, when None, a callback that drops every event."""
    return progress if progress is not None else noop
