"""How newcomers enter mlx-lm's batch (engines/llm.py, ``_admit``): with clean prefill groups
(a GPU's default), never merged into a prompt batch whose group joins the decode batch at
that step, and the same tokens as a sequence decoded alone; on the CPU (the default there)
mlx-lm groups them itself."""

from __future__ import annotations

import time

import mlx.core as mx
import pytest

from mlxd.core.types import SamplingParams
from mlxd.engines.llm import LLMEngine


@pytest.fixture()
def engine(tiny_llama) -> LLMEngine:
    e = LLMEngine("tiny", tiny_llama, max_num_seqs=8, prefix_cache_bytes=0,
                  clean_prefill_groups=True)
    e.bind()  # the batch on this thread's stream, as the device thread does
    return e


def _seq(engine: LLMEngine, text: str, n: int = 6):
    s = engine.new_sequence(engine.encode_prompt(text), SamplingParams(max_tokens=n,
                                                                       temperature=0.0))
    engine.add(s)
    s.t_added = time.monotonic() - 1.0  # waited long enough: no coalescing delay
    return s


def _step(engine: LLMEngine, out: dict[int, list[int]]) -> None:
    for seq, ev in engine.step():
        assert ev.error is None
        if ev.token is not None:
            out.setdefault(id(seq), []).append(ev.token)


def _tokens(engine: LLMEngine, seqs: list, out: dict | None = None) -> dict[int, list[int]]:
    out = {} if out is None else out
    for _ in range(200):
        if not engine.has_work():
            break
        _step(engine, out)
    return {id(s): out.get(id(s), []) for s in seqs}


def test_a_newcomer_waits_while_the_prefilled_group_joins_then_forms_its_own(engine):
    """The step after a group's prefill moves that group into the decode batch; a newcomer
    arriving then stays out of mlx-lm's prompt batch for that step and is prefilled in the
    next one, alone in a clean group."""
    seen: dict[int, list[int]] = {}
    first = [_seq(engine, "the river runs"), _seq(engine, "a city of music")]
    _step(engine, seen)  # admitted and prefilled up to their last tokens
    prompting = engine._gen._currently_processing
    assert len(prompting) == 2 and all(rows[0] == [rows[0][0]] and len(rows[0][0]) == 1
                                       for rows in prompting)
    late = _seq(engine, "winter morning in the library")
    _step(engine, seen)  # the group joins the decode batch; the newcomer is held
    assert late.uid == -1 and late in engine._pending
    assert len(engine._gen._prompt_batch) == 0
    assert engine.num_running == 2
    _step(engine, seen)  # now it goes in, alone
    assert late.uid >= 0 and late not in engine._pending
    assert engine._gen._prompt_batch.uids == [late.uid]

    got = _tokens(engine, [*first, late], seen)
    assert [len(got[id(s)]) for s in (*first, late)] == [6, 6, 6]
    # the held newcomer decodes exactly what it decodes alone
    alone = _seq(engine, "winter morning in the library")
    assert _tokens(engine, [alone])[id(alone)] == got[id(late)]


def test_a_prompt_mid_prefill_holds_nobody(tiny_llama):
    """A prompt longer than a prefill chunk is still being prefilled: newcomers join it."""
    engine = LLMEngine("tiny", tiny_llama, max_num_seqs=8, prefill_step_size=16,
                       prefix_cache_bytes=0, clean_prefill_groups=True)
    engine.bind()
    long = _seq(engine, " ".join(["ocean garden market"] * 20))
    seen: dict[int, list[int]] = {}
    _step(engine, seen)  # the first 16-token chunk
    assert any(len(rows[0][0]) > 1 for rows in engine._gen._currently_processing)
    late = _seq(engine, "a short one")
    _step(engine, seen)
    assert late.uid >= 0  # inserted at once, prefilled beside the long prompt's next chunk
    got = _tokens(engine, [long, late], seen)
    assert len(got[id(late)]) == 6 and len(got[id(long)]) == 6


def test_mlx_lm_gets_no_more_than_one_prefill_group_at_a_time(tiny_llama):
    """Twelve at once with a prefill batch of 8: eight go in as one group, four wait here
    (not in mlx-lm's own queue, whence they would be merged into the first group's
    joining step), and go in as the next clean group once the first has joined."""
    engine = LLMEngine("tiny", tiny_llama, max_num_seqs=16, prefix_cache_bytes=0,
                       clean_prefill_groups=True)
    engine.bind()
    seen: dict[int, list[int]] = {}
    seqs = [_seq(engine, f"story {i} of the ocean") for i in range(12)]
    _step(engine, seen)
    assert sorted(engine._gen._prompt_batch.uids) == sorted(s.uid for s in seqs[:8])
    assert len(engine._gen._unprocessed_sequences) == 0
    assert engine._pending == seqs[8:]
    _step(engine, seen)  # the first group joins; the rest still wait
    assert engine.num_running == 8 and engine._pending == seqs[8:]
    _step(engine, seen)
    assert engine._pending == [] and engine._gen._prompt_batch.uids == [s.uid for s in seqs[8:]]
    got = _tokens(engine, seqs, seen)
    assert all(len(got[id(s)]) == 6 for s in seqs)


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU's defaults")
def test_on_the_cpu_mlx_lm_groups_newcomers_itself(tiny_llama):
    """The CPU default: every newcomer goes to mlx-lm at once, as before clean groups."""
    engine = LLMEngine("tiny", tiny_llama, max_num_seqs=16, prefix_cache_bytes=0)
    engine.bind()
    assert not engine._clean_groups  # the tests run on the CPU
    seen: dict[int, list[int]] = {}
    seqs = [_seq(engine, f"story {i} of the ocean") for i in range(12)]
    _step(engine, seen)
    assert engine._pending == [] and all(s.uid >= 0 for s in seqs)
    got = _tokens(engine, seqs, seen)
    assert all(len(got[id(s)]) == 6 for s in seqs)


def test_an_idle_batch_takes_a_burst_as_one_group(engine, monkeypatch):
    """With nothing running, a newcomer waits while a burst still arrives (the last came
    less than BURST_GAP_S ago, the first at most two decode steps or 25 ms ago), so that
    clients starting together are prefilled together; a lone newcomer goes once the gap
    has passed."""
    from types import SimpleNamespace

    from mlxd.engines import llm

    now = [1000.0]
    monkeypatch.setattr(llm, "time", SimpleNamespace(monotonic=lambda: now[0],
                                                     perf_counter=time.perf_counter))
    gap = llm.BURST_GAP_S
    engine._step_ema = 0.010  # a 10 ms decode step: held at most 20 ms

    def arrive(text: str):
        s = engine.new_sequence(engine.encode_prompt(text),
                                SamplingParams(max_tokens=4, temperature=0.0))
        engine.add(s)
        return s

    first = arrive("the river runs")
    assert not engine.has_work() and engine.next_deadline() == pytest.approx(now[0] + gap)
    burst = [first]
    for i in range(4):  # one every 2 ms: each arrival extends the wait
        now[0] += 0.002
        burst.append(arrive(f"story {i} of the ocean"))
        assert not engine.has_work()
    now[0] += 0.002  # 10 ms after the first, 2 after the last
    assert not engine.has_work()
    now[0] += gap  # the burst is over
    assert engine.has_work()
    engine.step()
    assert sorted(engine._gen._prompt_batch.uids) == sorted(s.uid for s in burst)

    _tokens(engine, burst, {})
    engine._step_ema = 0.010  # (the steps just run moved it)
    # once the gap has passed, a lone newcomer goes alone
    lone = arrive("just me")
    assert not engine.has_work()
    now[0] += gap
    assert engine.has_work()
    engine.step()
    assert engine._gen._prompt_batch.uids == [lone.uid]


def test_a_burst_that_never_pauses_is_held_no_longer_than_the_cap(tiny_llama, monkeypatch):
    """Arrivals closer than the gap for longer than the cap (two decode steps): the first
    has waited the cap, and everything that came goes in as one group."""
    from types import SimpleNamespace

    from mlxd.engines import llm

    engine = LLMEngine("tiny", tiny_llama, max_num_seqs=16, prefill_batch_size=16,
                       prefix_cache_bytes=0, clean_prefill_groups=True)
    engine.bind()
    now = [1000.0]
    monkeypatch.setattr(llm, "time", SimpleNamespace(monotonic=lambda: now[0],
                                                     perf_counter=time.perf_counter))
    engine._step_ema = 0.010  # the cap: two decode steps, 20 ms
    seqs = []
    for i in range(10):  # one every 2 ms for 18 ms
        if i:
            now[0] += 0.002
        seqs.append(engine.new_sequence(engine.encode_prompt(f"story {i}"),
                                        SamplingParams(max_tokens=2)))
        engine.add(seqs[-1])
        assert not engine.has_work()
    now[0] = 1000.0205  # 20 ms after the first, 2.5 after the last
    assert engine.has_work()
    engine.step()
    assert sorted(engine._gen._prompt_batch.uids) == sorted(s.uid for s in seqs)


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU's defaults")
def test_on_the_cpu_an_idle_batch_takes_a_newcomer_at_once(tiny_llama):
    """The CPU default (no clean groups): no burst wait, as before."""
    engine = LLMEngine("tiny", tiny_llama, max_num_seqs=4, prefix_cache_bytes=0)
    engine.bind()
    seq = engine.new_sequence(engine.encode_prompt("now"), SamplingParams(max_tokens=2))
    engine.add(seq)
    assert engine.has_work() and engine.next_deadline() == 0.0
