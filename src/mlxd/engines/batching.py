"""Dynamic batching across callers for encoder engines (no MLX here: pure bookkeeping).

Requests arrive as :class:`EncodeJob` s (one per HTTP request) holding
:class:`EncodeItem` s (one per text, or per query-document pair). Items wait in one FIFO
queue per model. A batch *closes* when the queue holds ``max_batch_size`` items, or
``max_batch_tokens`` tokens, or when its oldest item has waited ``max_wait_s``; it then
takes the oldest items up to those limits (never fewer than one). Inside a closed batch the
items are sorted by length and cut into forward passes (:func:`split_by_length`) so that
little of any pass is padding; the engine runs one pass per worker step, so a big batch
never holds the device for long and LLM decode steps interleave between passes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from mlxd.core.types import EncodeEvent


@dataclass(eq=False)
class EncodeItem:
    index: int  # position in its request
    ids: list[int]
    types: list[int] | None = None  # token type ids (BERT sentence pairs)
    job: EncodeJob | None = None
    t_queued: float = 0.0

    @property
    def n(self) -> int:
        return len(self.ids)


@dataclass(eq=False)
class EncodeJob:
    """One request's inputs. ``handle`` (event loop, queue) belongs to the runtime."""

    items: list[EncodeItem]
    handle: Any = None
    cancelled: bool = False
    t_submitted: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        for it in self.items:
            it.job = self


@dataclass
class BatchPolicy:
    max_batch_size: int = 32
    max_batch_tokens: int = 16384
    max_wait_s: float = 0.005
    # The fixed cost of one forward pass, in tokens' worth of compute: what splitting a
    # batch into one more pass costs, against the padding the split saves.
    pass_overhead_tokens: int = 32


def split_by_length(
    items: list[EncodeItem], max_tokens: int, overhead: int
) -> list[list[EncodeItem]]:
    """Sort by length and cut into contiguous passes minimising padded tokens + overhead.

    Cost of a pass = ``overhead`` + rows x longest row; a pass of more than one row stays
    within ``max_tokens`` padded tokens. Exact dynamic programme over the sorted items
    (in windows of 128, so a huge batch costs no more than a few ms to plan).
    """
    s = sorted(items, key=lambda it: it.n)
    out: list[list[EncodeItem]] = []
    for w in range(0, len(s), 128):
        out.extend(_split_window(s[w : w + 128], max_tokens, overhead))
    return out


def _split_window(s: list[EncodeItem], max_tokens: int, overhead: int) -> list[list[EncodeItem]]:
    n = len(s)
    if n == 0:
        return []
    inf = float("inf")
    best = [0.0] + [inf] * n  # best[j]: cost of items[:j]
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = s[j - 1].n
        for i in range(j - 1, -1, -1):  # pass = items[i:j], padded to items[j-1]
            rows = j - i
            if rows > 1 and rows * longest > max_tokens:
                break
            c = best[i] + overhead + rows * longest
            if c < best[j]:
                best[j], cut[j] = c, i
    passes = []
    j = n
    while j > 0:
        i = cut[j]
        passes.append(s[i:j])
        j = i
    passes.reverse()
    return passes


class BatchQueue:
    """The waiting items of one model and the passes of the batch being run."""

    def __init__(self, policy: BatchPolicy, clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self.clock = clock
        self._queue: deque[EncodeItem] = deque()
        self._queued_tokens = 0
        self._passes: list[list[EncodeItem]] = []
        self.batches = 0

    # -- intake ------------------------------------------------------------------------
    def add(self, job: EncodeJob) -> None:
        now = self.clock()
        for it in job.items:
            it.t_queued = now
            self._queue.append(it)
            self._queued_tokens += it.n

    def cancel(self, job: EncodeJob) -> None:
        job.cancelled = True
        if any(it.job is job for it in self._queue):
            self._queue = deque(it for it in self._queue if it.job is not job)
            self._queued_tokens = sum(it.n for it in self._queue)
        self._passes = [
            p for p in ([it for it in p if it.job is not job] for p in self._passes) if p
        ]

    # -- state -------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    @property
    def num_running(self) -> int:
        return sum(len(p) for p in self._passes)

    def _ready(self, now: float) -> bool:
        q, p = self._queue, self.policy
        return bool(q) and (
            len(q) >= p.max_batch_size
            or self._queued_tokens >= p.max_batch_tokens
            or now >= q[0].t_queued + p.max_wait_s
        )

    def has_work(self) -> bool:
        return bool(self._passes) or self._ready(self.clock())

    def next_deadline(self) -> float | None:
        if self._passes or not self._queue:
            return None
        return self._queue[0].t_queued + self.policy.max_wait_s

    # -- batches -----------------------------------------------------------------------
    def _close_batch(self) -> None:
        p = self.policy
        batch: list[EncodeItem] = []
        tokens = 0
        while self._queue and len(batch) < p.max_batch_size:
            it = self._queue[0]
            if batch and tokens + it.n > p.max_batch_tokens:
                break
            self._queue.popleft()
            batch.append(it)
            tokens += it.n
        self._queued_tokens -= tokens
        self.batches += 1
        self._passes = split_by_length(batch, p.max_batch_tokens, p.pass_overhead_tokens)

    def next_pass(self) -> list[EncodeItem]:
        """The items of the next forward pass (closing a batch first if none is open)."""
        if not self._passes:
            if not self._queue:
                return []
            self._close_batch()
        return [it for it in self._passes.pop(0) if not it.job.cancelled]

    def drain(self) -> list[EncodeJob]:
        """Forget everything (after a failure); the jobs that were waiting or running."""
        jobs = jobs_of(list(self._queue) + [it for p in self._passes for it in p])
        self._queue.clear()
        self._queued_tokens = 0
        self._passes = []
        return jobs


def jobs_of(items: Iterable[EncodeItem]) -> list[EncodeJob]:
    """The distinct requests of ``items``, in first-seen order."""
    seen: dict[int, EncodeJob] = {}
    for it in items:
        if it.job is not None:
            seen.setdefault(id(it.job), it.job)
    return list(seen.values())


def events_for(items: list[EncodeItem], values: list[Any]) -> list[tuple[EncodeJob, Any]]:
    """One event per request touched by a pass (one thread hop per request, not per item)."""
    by_job: dict[int, tuple[EncodeJob, EncodeEvent]] = {}
    for it, v in zip(items, values, strict=True):
        job = it.job
        assert job is not None
        if job.cancelled:
            continue
        entry = by_job.get(id(job))
        if entry is None:
            entry = by_job[id(job)] = (job, EncodeEvent())
        entry[1].indices.append(it.index)
        entry[1].values.append(v)
    return list(by_job.values())


def error_events(jobs: list[EncodeJob], exc: Exception) -> list[tuple[EncodeJob, Any]]:
    return [
        (j, EncodeEvent(error=exc, finish_reason="error")) for j in jobs if j.handle is not None
    ]
