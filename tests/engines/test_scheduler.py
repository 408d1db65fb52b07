"""The admission order of engines/scheduler.py on plain sequences: priority, then service
divided by weight, then arrival; preemption for a strictly better priority, and for a key
with no running row while another holds more than its share."""

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


def test_a_starved_key_takes_one_row_from_the_key_over_its_share():
    sched = FairScheduler()
    sched.charge("a", 1000)
    running = [_seq(sched, "a") for _ in range(4)]
    queued_a = [_seq(sched, "a") for _ in range(3)]
    b = _seq(sched, "b")
    waiting = [*queued_a, b]
    assert sched.fair_victims(waiting, running, running, slots=4, free=0) == [running[-1]]
    assert sched.fair_victims(waiting, running, running, slots=4, free=1) == []  # a slot is free
    assert sched.pick(waiting, 1, running) == [b]  # and it goes to b
    assert sched.fair_victims(waiting, running, running[:2], slots=4, free=0) == [running[1]]
    # one row per starved key and round; a second key gets one too
    c = _seq(sched, "c")
    got = sched.fair_victims([*waiting, c], running, running, slots=4, free=0)
    assert got == [running[3], running[2]]


def test_no_fair_preemption_down_below_a_share_nor_to_zero_nor_for_a_running_key():
    sched = FairScheduler()
    a1, a2, b1 = _seq(sched, "a"), _seq(sched, "a"), _seq(sched, "b")
    a3, b2, c = _seq(sched, "a"), _seq(sched, "b"), _seq(sched, "c")
    # two keys both running: neither is starved
    assert sched.fair_victims([a3, b2], [a1, a2, b1], [a1, a2, b1], slots=3, free=0) == []
    # a holds 2 of 4 slots with b and c: share 4/3, it gives one row
    assert sched.fair_victims([c], [a1, a2, b1], [a1, a2, b1], slots=4, free=0) == [a2]
    # a holds 2 of 4 with one other key of weight 1: at its share, it keeps both
    assert sched.fair_victims([b2], [a1, a2], [a1, a2], slots=4, free=0) == []
    # one row is never taken
    assert sched.fair_victims([b2], [a1], [a1], slots=1, free=0) == []
    # a heavier key's share is larger: weight 3 of 4 of 4 slots is 3
    heavy = [_seq(sched, "h", weight=3) for _ in range(3)]
    assert sched.fair_victims([b2], heavy, heavy, slots=4, free=0) == []


def test_fair_preemption_respects_priority_and_the_line():
    sched = FairScheduler()
    sched.charge("a", 1000)
    urgent_a = [_seq(sched, "a", priority=0) for _ in range(2)]
    low_b = _seq(sched, "b", priority=10)
    # b waits at a worse priority than a's rows: it displaces none of them
    assert sched.fair_victims([low_b], urgent_a, urgent_a, slots=2, free=0) == []
    # a better priority waiting of a running key is first in line: b's turn is not next
    a_next = _seq(sched, "a", priority=5)
    low_a = [_seq(sched, "a", priority=10) for _ in range(2)]
    assert sched.fair_victims([low_b, a_next], low_a, low_a, slots=2, free=0) == []
    b0 = _seq(sched, "b", priority=10)
    assert sched.fair_victims([b0], low_a, low_a, slots=2, free=0) == [low_a[1]]


def test_batch_priority_and_queue_counts():
    from mlxd.core.types import BATCH_PRIORITY, PRIORITY_MAX

    sched = FairScheduler()
    waiting = [_seq(sched, priority=BATCH_PRIORITY), _seq(sched), _seq(sched)]
    assert BATCH_PRIORITY <= PRIORITY_MAX
    assert queue_by_priority(waiting) == {"0": 2, "100": 1}
