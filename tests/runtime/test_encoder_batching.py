"""The dynamic-batching bookkeeping of encoder engines (no MLX, no HTTP: a fake clock)."""

from __future__ import annotations

import itertools

from mlxd.engines.batching import (
    BatchPolicy,
    BatchQueue,
    EncodeItem,
    EncodeJob,
    events_for,
    split_by_length,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def job(*lengths: int) -> EncodeJob:
    return EncodeJob([EncodeItem(i, [7] * n) for i, n in enumerate(lengths)])


def test_a_batch_closes_on_size_tokens_or_wait():
    clock = Clock()
    q = BatchQueue(BatchPolicy(max_batch_size=4, max_batch_tokens=100, max_wait_s=0.005), clock)
    assert not q.has_work() and q.next_deadline() is None
    q.add(job(3))
    assert not q.has_work()  # alone and fresh: waits for company
    assert q.next_deadline() == 100.005
    clock.t += 0.006
    assert q.has_work()  # waited max_wait

    q2 = BatchQueue(BatchPolicy(max_batch_size=4, max_batch_tokens=100, max_wait_s=1), clock)
    q2.add(job(3, 3, 3))
    assert not q2.has_work()
    q2.add(job(3))
    assert q2.has_work()  # max_batch_size inputs

    q3 = BatchQueue(BatchPolicy(max_batch_size=64, max_batch_tokens=10, max_wait_s=1), clock)
    q3.add(job(6))
    assert not q3.has_work()
    q3.add(job(6))
    assert q3.has_work()  # the token budget


def test_batches_take_the_oldest_within_the_limits_and_run_pass_by_pass():
    clock = Clock()
    q = BatchQueue(BatchPolicy(max_batch_size=3, max_batch_tokens=1000, max_wait_s=0), clock)
    a, b = job(5, 5), job(5, 5)
    q.add(a)
    q.add(b)
    first = q.next_pass()
    assert [it.job for it in first] == [a, a, b]  # oldest first, at most 3
    assert q.num_waiting == 1
    second = q.next_pass()
    assert [it.job for it in second] == [b]


def test_a_single_long_input_runs_even_over_the_token_budget():
    q = BatchQueue(BatchPolicy(max_batch_size=8, max_batch_tokens=10, max_wait_s=0), Clock())
    q.add(job(50, 2))
    assert [it.n for it in q.next_pass()] == [50]
    assert [it.n for it in q.next_pass()] == [2]


def test_split_by_length_sorts_and_pads_little():
    items = [EncodeItem(i, [1] * n) for i, n in enumerate([30, 5, 6, 31, 5, 29, 7, 6])]
    passes = split_by_length(items, max_tokens=10_000, overhead=8)
    assert sorted(it.index for p in passes for it in p) == list(range(8))
    lengths = [[it.n for it in p] for p in passes]
    assert lengths == [[5, 5, 6, 6, 7], [29, 30, 31]]
    # The plan is optimal: no other contiguous split of the sorted items costs less.
    s = sorted(it.n for it in items)

    def cost(cuts):
        bounds = [0, *cuts, len(s)]
        return sum(8 + (j - i) * s[j - 1] for i, j in itertools.pairwise(bounds))

    best = min(cost(c) for r in range(len(s)) for c in itertools.combinations(range(1, len(s)), r))
    assert cost([5]) == best
    # A pass never holds more than max_tokens padded tokens (unless it is one input).
    passes = split_by_length(items, max_tokens=40, overhead=8)
    assert all(len(p) == 1 or len(p) * max(it.n for it in p) <= 40 for p in passes)


def test_cancel_removes_waiting_and_planned_inputs():
    q = BatchQueue(BatchPolicy(max_batch_size=2, max_batch_tokens=1000, max_wait_s=0), Clock())
    a, b = job(4, 4, 4), job(4)
    q.add(a)
    q.add(b)
    q.cancel(a)
    assert a.cancelled and q.num_waiting == 1
    assert [it.job for it in q.next_pass()] == [b]
    assert not q.has_work()


def test_events_group_results_per_request_and_skip_cancelled_ones():
    a, b = job(1, 1), job(1)
    items = [a.items[1], b.items[0], a.items[0]]
    ev = dict((id(j), e) for j, e in events_for(items, ["x", "y", "z"]))
    assert ev[id(a)].indices == [1, 0] and ev[id(a)].values == ["x", "z"]
    b.cancelled = True
    assert [j for j, _ in events_for(items, ["x", "y", "z"])] == [a]


def test_batch_settings_from_yaml_and_both_env_spellings(tmp_path, monkeypatch):
    from mlxd.config import load_settings
    from mlxd.engines.encoder import batch_policy, llm_batch_policy

    (tmp_path / "c.yaml").write_text("batch:\n  max_batch_size: 8\n  max_wait_ms: 1\n")
    monkeypatch.setenv("MLXD_BATCH_MAX_WAIT_MS", "2.5")  # the flat name
    monkeypatch.setenv("MLXD_BATCH__MAX_BATCH_TOKENS", "4096")  # the nested one
    s = load_settings(tmp_path / "c.yaml")
    assert (s.batch.max_batch_size, s.batch.max_wait_ms, s.batch.max_batch_tokens) == (8, 2.5, 4096)
    p = batch_policy(s)
    assert (p.max_batch_size, p.max_wait_s, p.max_batch_tokens) == (8, 0.0025, 4096)
    # LLM rerankers pass no more tokens than one prefill step of the chat engine
    e = s.engine
    assert llm_batch_policy(s).max_batch_tokens == min(
        4096, e.prefill_batch_size * e.prefill_step_size
    )


def test_a_failing_pass_fails_only_its_own_requests():
    from mlxd.engines.encoder import BatchingEncoder

    class Flaky(BatchingEncoder):
        def _forward(self, items):
            if any(it.ids[0] == 13 for it in items):
                raise RuntimeError("boom")
            return [it.n for it in items]

    eng = Flaky("flaky", BatchPolicy(max_batch_size=1, max_wait_s=0))
    bad = EncodeJob([EncodeItem(0, [13]), EncodeItem(1, [1])])
    good = EncodeJob([EncodeItem(0, [1, 1])])
    for j in (bad, good):
        j.handle = object()
        eng.add(j)
    ((job1, ev1),) = eng.step()
    assert job1 is bad and "boom" in str(ev1.error)
    ((job2, ev2),) = eng.step()  # bad's second input is dropped, good's runs
    assert job2 is good and ev2.values == [2] and ev2.error is None
    assert not eng.has_work() and eng.max_batch_seen == 1
