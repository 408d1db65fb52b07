"""One sequence's failure is its own: admission and per-row processors (engines/llm.py)."""

from __future__ import annotations

import time

import pytest

from mlxd.core.types import SamplingParams
from mlxd.engines import llm as llm_module
from mlxd.engines.llm import LLMEngine
from mlxd.engines.options import TextEngineOptions


@pytest.fixture(scope="module")
def engine(tiny_llama) -> LLMEngine:
    e = LLMEngine("tiny", tiny_llama, TextEngineOptions(max_num_seqs=8))
    e.bind()  # the batch (on this thread's stream, as the device thread does)
    return e


def _drive(engine: LLMEngine, seqs: list) -> dict[int, list]:
    for s in seqs:
        engine.add(s)
    for s in seqs:
        s.t_added = time.monotonic() - 1.0  # waited long enough: no coalescing delay
    events: dict[int, list] = {id(s): [] for s in seqs}
    for _ in range(500):
        if not engine.has_work():
            break
        for seq, ev in engine.step():
            events[id(seq)].append(ev)
    assert not engine.has_work()
    return events


class _BrokenMatcher:
    """An llguidance matcher stand-in that fails as soon as it is asked anything."""

    def is_stopped(self) -> bool:
        raise RuntimeError("matcher exploded")

    is_error = is_stopped

    def compute_bitmask(self) -> bytes:
        raise RuntimeError("matcher exploded")


def test_a_failing_row_processor_ends_that_row_alone(engine):
    ids = engine.encode_prompt("hello there")
    good = engine.new_sequence(ids, SamplingParams(max_tokens=6, temperature=0.0))
    bad = engine.new_sequence(
        ids, SamplingParams(max_tokens=6, temperature=0.0), grammar=_BrokenMatcher()
    )
    other = engine.new_sequence(ids, SamplingParams(max_tokens=6, temperature=0.7, seed=3))
    ev = _drive(engine, [good, bad, other])
    assert [e.finish_reason for e in ev[id(bad)]][-1] == "error"
    assert "matcher exploded" in str(ev[id(bad)][-1].error)
    for s in (good, other):
        assert [e.error for e in ev[id(s)]] == [None] * 6
        assert ev[id(s)][-1].finish_reason == "length"


def test_a_newcomer_whose_state_cannot_be_built_fails_alone(engine, monkeypatch):
    real = llm_module.build_sampler

    def build(params, vocab):
        if params.seed == 666:
            raise ValueError("cannot build this sampler")
        return real(params, vocab)

    monkeypatch.setattr(llm_module, "build_sampler", build)
    ids = engine.encode_prompt("hi")
    ok = engine.new_sequence(ids, SamplingParams(max_tokens=4, temperature=0.0))
    broken = engine.new_sequence(ids, SamplingParams(max_tokens=4, temperature=0.9, seed=666))
    ev = _drive(engine, [ok, broken])
    assert len(ev[id(broken)]) == 1 and ev[id(broken)][0].finish_reason == "error"
    assert ev[id(ok)][-1].finish_reason == "length" and len(ev[id(ok)]) == 4
    assert ev[id(ok)][0].queued_s is not None  # the first token says how long it waited


def test_fail_all_ends_waiting_sequences_too(engine):
    ids = engine.encode_prompt("hello")
    running = engine.new_sequence(ids, SamplingParams(max_tokens=50, temperature=0.0))
    engine.add(running)
    running.t_added = time.monotonic() - 1.0
    engine.step()
    waiting = engine.new_sequence(ids, SamplingParams(max_tokens=5, temperature=0.0))
    engine.add(waiting)  # held back for coalescing behind the running batch
    out = engine.fail_all(RuntimeError("device fault"))
    assert {id(s) for s, _ in out} == {id(running), id(waiting)}
    assert all(e.finish_reason == "error" for _, e in out)
    assert not engine.has_work()  # nothing left to decode as a ghost
    assert _drive(engine, [engine.new_sequence(ids, SamplingParams(max_tokens=2))])
