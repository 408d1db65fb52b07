"""The admission order of engines/scheduler.py on plain sequences: priority, then service
divided by weight, then arrival; preemption only for a strictly better priority."""

from __future__ import annotations

from mlxd.core.types import SamplingParams
from mlxd.engines.decode import Sequence
from mlxd.engines.scheduler import FairScheduler, queue_by_priority


def _seq(sched: FairScheduler, tenant: str = "", priority: int = 0, weight: float = 1.0):
    s = Sequence([1, 2, 3], SamplingParams())
    s.tenant, s.priority, s.weight = tenant, priority, weight
    sched.arrive(s)
    return s


def test_priority_first_then_arrival_within_one_tenant():
    sched = FairScheduler()
    a, b, c = _seq(sched, priority=10), _seq(sched, priority=0), _seq(sched, priority=10)
    assert sched.pick([a, b, c], 2) == [b, a]
    assert sched.pick([c, a], 1) == [a]  # arrival, not list order


def test_the_least_served_key_goes_first_and_weight_divides_service():
    sched = FairScheduler()
    sched.charge("a", 100, now=0.0)
    sched.charge("b", 60, now=0.0)
    a, b = _seq(sched, "a", weight=1), _seq(sched, "b")
    assert sched.pick([a, b], 1) == [b]
    a2 = _seq(sched, "a", weight=2)  # 100 / 2 < 60
    assert sched.pick([b, a2], 1) == [a2]


def test_one_round_shares_its_slots():
    """Each pick counts toward its key's share, so two free slots go to two keys."""
    sched = FairScheduler()
    a1, a2, b1 = _seq(sched, "a"), _seq(sched, "a"), _seq(sched, "b")
    assert sched.pick([a1, a2, b1], 2) == [a1, b1]


def test_service_decays_by_half_each_half_life():
    sched = FairScheduler(half_life_s=10.0)
    sched.charge("a", 80, now=100.0)
    assert sched.service("a", now=110.0) == 40.0
    assert sched.service("a", now=120.0) == 20.0
    assert sched.service("nobody") == 0.0


def test_a_preemption_only_for_a_strictly_better_priority():
    sched = FairScheduler()
    r1, r2 = _seq(sched, priority=10), _seq(sched, priority=10)
    same = _seq(sched, priority=10)
    assert sched.victims([same], [r1, r2], free=0) == []
    urgent = _seq(sched, priority=0)
    assert sched.victims([urgent], [r1, r2], free=0) == [r2]  # the latest arrival
    assert sched.victims([urgent], [r1, r2], free=1) == []  # a slot is free anyway
    u2 = _seq(sched, priority=5)
    assert sched.victims([u2, urgent], [r1, r2], free=0) == [r2, r1]


def test_batch_priority_and_queue_counts():
    from mlxd.core.types import BATCH_PRIORITY, PRIORITY_MAX

    sched = FairScheduler()
    waiting = [_seq(sched, priority=BATCH_PRIORITY), _seq(sched), _seq(sched)]
    assert BATCH_PRIORITY <= PRIORITY_MAX
    assert queue_by_priority(waiting) == {"0": 2, "100": 1}
