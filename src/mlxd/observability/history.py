"""The last minutes of this front end, kept in memory for the web UI (mlxd/ui/).

Two ring buffers, both bounded and cheap enough to keep always on:

* :class:`RequestLog`: the last N finished requests as the access log saw them (its fields
  and its very line), so that the UI's request list links a request id to its log line
  without reading a log file. Each remembers its caller's owner id (api/owner.py), so that
  a key is shown only its own requests.
* :class:`StatsSampler`: every ``interval`` seconds, a reading of this process's own
  Prometheus counters (observability/metrics.py), turned into per-interval rates: tokens/s,
  mean time to first token, running/waiting requests and finished requests by status class.
  No Prometheus server is needed to draw the charts; Prometheus itself sees the same
  counters on ``/metrics`` (deploy/grafana/ draws them over longer spans).

Each front-end process keeps its own (``--api-workers N``: each worker sees its share).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mlxd.observability import metrics


class RequestLog:
    """The last ``size`` access-log records, newest last, each with its caller's owner id."""

    def __init__(self, size: int = 500) -> None:
        self._items: deque[tuple[str | None, dict[str, Any]]] = deque(maxlen=size)

    def add(self, fields: dict[str, Any], line: str, owner: str | None = None) -> None:
        self._items.append((owner, {**fields, "time": time.time(), "line": line}))

    def recent(
        self, limit: int | None = None, visible: Callable[[str | None], bool] | None = None
    ) -> list[dict[str, Any]]:
        """Newest first; ``visible(owner)`` picks the records a caller may see (the limit
        counts those only)."""
        out: list[dict[str, Any]] = []
        for owner, record in reversed(self._items):
            if limit is not None and len(out) >= limit:
                break
            if visible is None or visible(owner):
                out.append(record)
        return out


def _total(metric: Any, sample: str, keep: Callable[[dict[str, str]], bool] | None = None) -> float:
    """The sum of one sample name over every label set of a metric (``keep`` filters)."""
    total = 0.0
    for family in metric.collect():
        for s in family.samples:
            if s.name == sample and (keep is None or keep(s.labels)):
                total += s.value
    return total


def status_class(status: str) -> str:
    return f"{status[:1]}xx" if status[:1] in "12345" and status else "other"


@dataclass
class Reading:
    """Cumulative counters and gauges at one instant."""

    t: float
    generation_tokens: float
    prompt_tokens: float
    ttft_sum: float
    ttft_count: float
    running: float
    waiting: float
    by_status: dict[str, float]


def read_counters(skip_route: Callable[[str], bool]) -> Reading:
    """This process's metrics now. ``skip_route``: HTTP routes not counted as requests
    (the UI's own polling would otherwise fill the requests chart)."""
    by_status: dict[str, float] = {}
    for family in metrics.http_requests_total.collect():
        for s in family.samples:
            if s.name.endswith("_total") and not skip_route(s.labels.get("route", "")):
                cls = status_class(s.labels.get("status", ""))
                by_status[cls] = by_status.get(cls, 0.0) + s.value
    return Reading(
        t=time.time(),
        generation_tokens=_total(metrics.generation_tokens_total, "mlxd:generation_tokens_total"),
        prompt_tokens=_total(metrics.prompt_tokens_total, "mlxd:prompt_tokens_total"),
        ttft_sum=_total(metrics.time_to_first_token, "mlxd:time_to_first_token_seconds_sum"),
        ttft_count=_total(metrics.time_to_first_token, "mlxd:time_to_first_token_seconds_count"),
        running=_total(metrics.num_requests_running, "mlxd:num_requests_running"),
        waiting=_total(metrics.num_requests_waiting, "mlxd:num_requests_waiting"),
        by_status=by_status,
    )


def point(prev: Reading, cur: Reading) -> dict[str, Any]:
    """One chart point: what happened between two readings."""
    dt = max(cur.t - prev.t, 1e-6)
    n_first = cur.ttft_count - prev.ttft_count
    return {
        "t": round(cur.t, 3),
        "tokens_per_s": round((cur.generation_tokens - prev.generation_tokens) / dt, 3),
        "prompt_tokens_per_s": round((cur.prompt_tokens - prev.prompt_tokens) / dt, 3),
        # mean over the requests whose first token came in this interval; None: none did
        "ttft_ms": round((cur.ttft_sum - prev.ttft_sum) / n_first * 1000, 3)
        if n_first > 0
        else None,
        "running": cur.running,
        "waiting": cur.waiting,
        "requests": {
            cls: cur.by_status.get(cls, 0.0) - prev.by_status.get(cls, 0.0)
            for cls in sorted(set(cur.by_status) | set(prev.by_status))
        },
    }


class StatsSampler:
    """Samples :func:`read_counters` every ``interval`` seconds into a ring of points."""

    def __init__(
        self, skip_route: Callable[[str], bool], interval: float = 2.0, size: int = 300
    ) -> None:
        self.interval = interval
        self.skip_route = skip_route
        self.points: deque[dict[str, Any]] = deque(maxlen=size)
        self._last: Reading | None = None
        self._task: asyncio.Task | None = None

    def sample(self) -> None:
        cur = read_counters(self.skip_route)
        if self._last is not None:
            self.points.append(point(self._last, cur))
        self._last = cur

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def series(self, since: float = 0.0) -> list[dict[str, Any]]:
        return [p for p in self.points if p["t"] > since]
