"""Who gets the next free slot of a decode engine: priorities, then fair shares by key.

A waiting sequence with the best (smallest) priority goes first. Among equal priorities,
a tenant (the API key's owner id, api/owner.py) with no running row goes first, then the
one with the least service received: prompt tokens prefilled plus tokens decoded, decaying
with a half-life of :data:`HALF_LIFE_S` and divided by the key's weight. Within one tenant,
first come, first served; with no keys configured every caller is one tenant, so the order
is FIFO within a priority.

A waiting sequence with a strictly better priority than a running one may take that row's
slot (:meth:`FairScheduler.victims`): the engine moves the row's KV to the prefix cache and
queues it again with its output appended to its prompt, so it resumes where it stopped.

Fairness preempts only for a starved tenant (:meth:`FairScheduler.fair_victims`): one with
waiting sequences and no running row, first in line for the next slot, while another tenant
holds more than its weighted share of the slots and at least two rows. That tenant gives up
one row (at the starved one's priority or worse) per starved tenant and round. It cannot
thrash: a tenant gives up rows only while it holds more than its share, never its last, so
it still runs and never counts as starved itself; and a free slot goes first to a tenant
with no running row (:meth:`FairScheduler.pick`), so tenants that all have rows never
preempt one another.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

# Service received decays by half over this many seconds: a key that flooded the server a
# few minutes ago is not held back for it now.
HALF_LIFE_S = 60.0


class FairScheduler:
    """The order of an engine's waiting sequences (their ``priority``, ``tenant``,
    ``weight`` and ``arrival``, engines/decode.py's Sequence)."""

    def __init__(self, half_life_s: float = HALF_LIFE_S) -> None:
        self.half_life_s = half_life_s
        self._service: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, as of when)
        self._arrivals = itertools.count(1)
        self.preemptions = 0

    def arrive(self, seq: Any) -> None:
        """Number ``seq`` in admission order (once: a preempted row keeps its place)."""
        if not seq.arrival:
            seq.arrival = next(self._arrivals)

    def service(self, tenant: str, now: float | None = None) -> float:
        """The tenant's decayed service (tokens), not yet divided by its weight."""
        got = self._service.get(tenant)
        if got is None:
            return 0.0
        value, at = got
        now = time.monotonic() if now is None else now
        return value * 0.5 ** (max(now - at, 0.0) / self.half_life_s)

    def charge(self, tenant: str, tokens: int, now: float | None = None) -> None:
        """``tokens`` more service for ``tenant`` (prefilled or decoded)."""
        if tokens <= 0:
            return
        now = time.monotonic() if now is None else now
        self._service[tenant] = (self.service(tenant, now) + tokens, now)
        if len(self._service) > 4096:  # long-gone tenants: what decayed to nothing goes
            self._service = {t: v for t, v in self._service.items() if self.service(t, now) >= 1.0}

    def pick(self, waiting: list[Any], n: int, running: Iterable[Any] = ()) -> list[Any]:
        """The ``n`` waiting sequences that go next, in order. At one priority a tenant
        with no row in ``running`` goes first (else it would have to preempt for its
        slot), then the least served. Each pick counts its prompt toward its tenant's share
        of this round, so one round does not hand every slot to the tenant that was
        behind."""
        if n <= 0 or not waiting:
            return []
        if n >= len(waiting):  # every one goes now
            return sorted(waiting, key=lambda s: (s.priority, s.arrival))
        return self._line(waiting, n, {s.tenant for s in running})

    def _line(self, waiting: list[Any], n: int, busy: set[str]) -> list[Any]:
        """The first ``n`` of ``waiting`` in admission order (see :meth:`pick`)."""
        now = time.monotonic()
        share = {s.tenant: self.service(s.tenant, now) for s in waiting}
        left = sorted(waiting, key=lambda s: (s.priority, s.arrival))
        busy = set(busy)
        out: list[Any] = []
        while left and len(out) < n:
            best = min(
                left,
                key=lambda s: (
                    s.priority,
                    s.tenant in busy,
                    share[s.tenant] / max(s.weight, 1e-9),
                    s.arrival,
                ),
            )
            left.remove(best)
            out.append(best)
            share[best.tenant] += len(best.prompt_tokens)
            busy.add(best.tenant)
        return out

    def victims(self, waiting: list[Any], running: list[Any], free: int) -> list[Any]:
        """Running rows to preempt so that waiting sequences of a strictly better priority
        run now: one per such sequence beyond the ``free`` slots, the worst priority
        first, the latest arrival among equals."""
        if not waiting or not running:
            return []
        better = sorted(s.priority for s in waiting)
        worst = sorted(running, key=lambda s: (s.priority, s.arrival), reverse=True)
        out: list[Any] = []
        for prio in better[max(free, 0) :]:
            if not worst or prio >= worst[0].priority:
                break
            out.append(worst.pop(0))
        return out

    def fair_victims(
        self, waiting: list[Any], running: list[Any], preemptible: list[Any], slots: int, free: int
    ) -> list[Any]:
        """Rows of ``preemptible`` (a subset of ``running``) to preempt so that starved
        tenants (waiting, no row in ``running``) get a slot now: walking the line beyond
        the ``free`` slots, one row per starved tenant in it, from the tenant furthest over
        its weighted share of ``slots`` (share: slots * weight / the weights of the tenants
        running or waiting) that holds two rows or more, its latest arrival at the starved
        tenant's priority or worse. The walk stops at the first sequence of a tenant that
        is not starved: the slot would go to it, not to a starved one."""
        busy = {s.tenant for s in running}
        starved = {s.tenant for s in waiting} - busy
        if not starved or not preemptible or slots <= 0:
            return []
        weight: dict[str, float] = {}
        for s in [*running, *waiting]:
            weight[s.tenant] = max(weight.get(s.tenant, 0.0), max(s.weight, 1e-9))
        total = sum(weight.values())
        rows = Counter(s.tenant for s in running)
        free = max(free, 0)
        line = self._line(waiting, free + len(starved), busy)
        out: list[Any] = []
        taken: set[int] = set()
        for i, seq in enumerate(line):
            if i < free:  # a free slot: it needs no victim
                starved.discard(seq.tenant)
                continue
            if seq.tenant not in starved:
                break
            over = [t for t, n in rows.items() if n >= 2 and n > slots * weight[t] / total]
            victim = None
            for t in sorted(over, key=lambda t: rows[t] / weight[t], reverse=True):
                mine = [
                    r
                    for r in preemptible
                    if r.tenant == t and id(r) not in taken and r.priority >= seq.priority
                ]
                if mine:
                    victim = max(mine, key=lambda r: r.arrival)
                    break
            if victim is None:
                break
            out.append(victim)
            taken.add(id(victim))
            rows[victim.tenant] -= 1
            starved.discard(seq.tenant)
        return out


def queue_by_priority(waiting: list[Any]) -> dict[str, int]:
    """Waiting sequences counted by priority, for /health (keys are strings: JSON's)."""
    return {str(k): v for k, v in sorted(Counter(s.priority for s in waiting).items())}
