"""The rule that decides whether a step speculates (engines/speculative.py CostModel),
driven by a simulated engine on a fake clock: a plain step leaves its next forward pass in
flight, which the following step waits for, as mlx-lm's pipelined step does; a
speculating step waits for what is in flight, then runs synchronously. Deterministic: the
clock moves only by the costs each test gives."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from mlxd.engines.speculative import CostModel, Speculator, batch_bucket


@dataclass
class Sim:
    """Steps of a batch whose plain forward pass costs ``plain`` seconds and whose
    speculating step costs ``spec`` seconds and emits ``tokens`` per row."""

    plain: float
    spec: float
    tokens: float
    now: float = 0.0
    in_flight: float = 0.0  # the forward pass a plain step left running
    cost: CostModel = field(init=False)
    choices: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.cost = CostModel(clock=lambda: self.now)

    def run(self, steps: int, n: int = 1) -> list[bool]:
        """``steps`` steps of ``n`` rows; what each chose."""
        out = []
        for _ in range(steps):
            speculate = self.cost.choose(n)
            self.now += self.in_flight + 0.0001  # waiting for it, and some host work
            if speculate:
                self.now += self.spec
                self.in_flight = 0.0
            else:
                self.in_flight = self.plain
            self.cost.step_done(n, speculate, self.tokens if speculate else 1.0)
            out.append(speculate)
        self.choices += out
        return out


def test_where_speculating_is_faster_nearly_every_step_speculates():
    sim = Sim(plain=0.010, spec=0.012, tokens=2.5)
    sim.run(1000)
    bucket = sim.cost.buckets[1]
    assert bucket.speculate
    assert bucket.gain() == pytest.approx(2.5 * 0.0101 / 0.0121, rel=0.01)
    assert sum(sim.choices[100:]) / 900 > 0.97  # plain only to keep its estimate fresh


def test_where_speculating_is_slower_almost_no_step_speculates():
    """Acceptance too low for the verify pass's cost: plain decoding, with a try of
    speculation now and then whose interval doubles while it keeps losing."""
    sim = Sim(plain=0.010, spec=0.030, tokens=1.3)
    sim.run(3000, n=16)
    bucket = sim.cost.buckets[16]
    assert not bucket.speculate
    assert bucket.gain() < 1
    assert sum(sim.choices) / len(sim.choices) < 0.01
    starts = [i for i in range(1, len(sim.choices)) if sim.choices[i] and not sim.choices[i - 1]]
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] > 2 * gaps[0]


def test_tries_of_the_losing_kind_lose_at_most_the_budget():
    """A verify pass four times a plain step's cost (16 rows on a CPU): the tries of
    speculation are spaced so that they cost about ``explore_budget`` of the time that
    plain decoding alone would take, not a quarter of it."""
    sim = Sim(plain=0.010, spec=0.040, tokens=1.3)
    sim.run(4000, n=16)
    plain_only = 4000 * (0.010 + 0.0001)  # each step waits for the one in flight
    assert not sim.cost.buckets[16].speculate
    assert sim.now / plain_only < 1 + 1.5 * sim.cost.explore_budget


def test_a_larger_batch_waits_to_try_where_a_smaller_one_lost():
    """Eight rows found speculating slower; sixteen rows' first try waits as long as the
    retries at eight do instead of coming with their first decision."""
    sim = Sim(plain=0.010, spec=0.040, tokens=1.3)
    sim.run(500, n=8)
    assert not sim.cost.buckets[8].speculate
    assert not any(sim.run(sim.cost.explore_min * 4, n=16))
    fresh = Sim(plain=0.010, spec=0.040, tokens=1.3)
    assert any(fresh.run(sim.cost.explore_min * 4, n=16))  # alone, it tries at once


def test_a_small_gain_inside_the_margin_stays_plain():
    sim = Sim(plain=0.010, spec=0.0101, tokens=1.03)
    sim.run(500)
    assert not sim.cost.buckets[1].speculate


def test_no_more_tokens_per_step_is_never_a_gain_whatever_the_clock_says():
    """On a loaded host wall times are noisy: speculating steps that found nothing to
    accept (one token per row) once measured cheaper than plain ones. Such a step costs
    at least a plain step, so the rule stays plain."""
    sim = Sim(plain=0.050, spec=0.010, tokens=1.0)
    sim.run(500)
    bucket = sim.cost.buckets[1]
    assert bucket.gain() > 2 and not bucket.speculate


def test_when_the_text_starts_repeating_speculation_takes_over():
    """Low acceptance first (plain wins), then drafts that land: a try of speculation
    finds it faster and the rule switches, within the longest retry interval."""
    sim = Sim(plain=0.010, spec=0.015, tokens=1.1)
    sim.run(2000)
    assert not sim.cost.buckets[1].speculate
    sim.tokens = 3.0
    sim.run(sim.cost.explore_max + 2 * sim.cost.burst)
    assert sim.cost.buckets[1].speculate
    assert sum(sim.run(50)) >= 45


def test_and_when_it_stops_repeating_plain_decoding_comes_back():
    sim = Sim(plain=0.010, spec=0.012, tokens=3.0)
    sim.run(1000)
    assert sim.cost.buckets[1].speculate
    sim.tokens = 1.0  # the same cost, nothing accepted
    sim.run(sim.cost.explore_max)
    assert not sim.cost.buckets[1].speculate


def test_batch_sizes_are_measured_apart():
    """Speculating pays at one row and not at sixteen, where the verify pass costs more
    than its extra tokens bring: each bucket decides for itself."""
    sim = Sim(plain=0.010, spec=0.012, tokens=2.5)
    sim.run(500, n=1)
    sim.plain, sim.spec = 0.020, 0.070
    sim.run(500, n=16)
    buckets = sim.cost.as_dict()
    assert buckets["1"]["decision"] == "speculate" and buckets["16"]["decision"] == "plain"
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 7, 8, 15, 16, 17)] == [
        1, 2, 2, 4, 4, 8, 8, 16, 16
    ]  # fmt: skip


def test_a_step_after_the_other_kind_or_a_prefill_gives_no_sample():
    """After a speculating step nothing is in flight, so the plain step that follows
    returns at once; after a plain step the speculating one also waits out the plain
    pass. Neither is that step's own cost, nor is a step after a prefill."""
    now = [0.0]
    cost = CostModel(clock=lambda: now[0])
    for t, spec in [(1.0, True), (1.001, False), (1.011, False), (1.021, False)]:
        now[0] = t
        cost.step_done(1, spec, 1.0)
    assert cost.buckets[1].plain_samples == 2
    assert cost.buckets[1].plain_s == pytest.approx(0.010)
    cost.interrupt()  # a prefill ran: the next step's wall time includes it
    now[0] = 2.0
    cost.step_done(1, False, 1.0)
    assert cost.buckets[1].plain_samples == 2
    now[0] = 2.05
    cost.step_done(1, True, 3.0)  # after a plain step: no sample
    assert cost.buckets[1].spec_samples == 0


def test_an_outlier_step_moves_the_estimate_a_bounded_amount():
    now = [0.0]
    cost = CostModel(clock=lambda: now[0])
    for t in (0.0, 0.01, 0.02, 0.03, 5.0):  # the last: the host was away for 5 s
        now[0] = t
        cost.step_done(1, False, 1.0)
    assert cost.buckets[1].plain_s < 0.03


def test_the_speculator_applies_the_cap_and_the_policy():
    spec = Speculator("prompt-lookup", max_batch=4)
    assert not spec.speculates(5)
    assert spec.stats.large_batch_steps == 1 and spec.stats.plain_steps == 1
    assert not spec.speculates(2)  # the rule measures plain decoding first
    assert spec.stats.cost_plain_steps == 1
    always = Speculator("prompt-lookup", policy="always")
    assert all(always.speculates(n) for n in (1, 16, 256))  # no cap by default
    health = spec.as_dict()
    assert health["policy"] == "cost" and health["max_batch"] == 4
    assert health["buckets"]["2"]["decision"] == "plain"
    assert always.as_dict()["max_batch"] is None
