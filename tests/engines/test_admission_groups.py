"""How newcomers enter mlx-lm's batch (engines/llm.py, ``_admit``): with clean prefill groups
(a GPU's default), never merged into a prompt batch whose group joins the decode batch at
that step, and the same tokens as a sequence decoded alone; on the CPU (the default there)
mlx-lm groups them itself."""

from __future__ import annotations

import time

import mlx.core as mx
import pytest
from fixtures.hybrid_models import HYBRID_ARCHS, make_tiny_hybrid_model

from mlxd.core.types import SamplingParams
from mlxd.engines.llm import LLMEngine
from mlxd.engines.options import TextEngineOptions


def _bound(engine: LLMEngine, prompt_end: bool = True) -> LLMEngine:
    """The engine's batch built on this thread's stream, as the device thread does; with
    ``prompt_end`` off, on mlx-lm's path (a model whose first token cannot come from its
    prefill pass: engines/prompt_end.py)."""
    assert engine._prompt_end  # the tiny Llama supports it
    engine._prompt_end = prompt_end
    engine.bind()
    return engine


@pytest.fixture()
def engine(tiny_llama) -> LLMEngine:
    return _bound(
        LLMEngine(
            "tiny",
            tiny_llama,
            TextEngineOptions(max_num_seqs=8, prefix_cache_bytes=0, clean_prefill_groups=True),
        )
    )


@pytest.fixture()
def groups(monkeypatch) -> list[list[int]]:
    """The uids of every prefill pass, in order."""
    from mlxd.engines.serving_batch import ServingPromptBatch

    seen: list[list[int]] = []
    real = ServingPromptBatch._prefill

    def recording(self, tokens, last):
        if self.uids:  # mlx-lm runs its prompt batch at every step, empty or not
            seen.append(list(self.uids))
        return real(self, tokens, last)

    monkeypatch.setattr(ServingPromptBatch, "_prefill", recording)
    return seen


def _seq(engine: LLMEngine, text: str, n: int = 6):
    s = engine.new_sequence(
        engine.encode_prompt(text), SamplingParams(max_tokens=n, temperature=0.0)
    )
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


def test_a_group_joins_in_its_prefill_step_and_the_next_newcomer_forms_its_own(engine):
    """With the first token from the prefill pass, a group prefilled in a step has joined
    the decode batch at its end; a newcomer arriving then is prefilled in the next step,
    alone, and decodes what it decodes alone."""
    seen: dict[int, list[int]] = {}
    first = [_seq(engine, "the river runs"), _seq(engine, "a city of music")]
    _step(engine, seen)  # prefilled through their last tokens, and joined
    assert engine._gen._currently_processing == [] and len(engine._gen._prompt_batch) == 0
    assert engine.num_running == 2 and seen == {}
    late = _seq(engine, "winter morning in the library")
    _step(engine, seen)  # the group's first tokens; the newcomer prefilled and joined
    assert [len(seen[id(s)]) for s in first] == [1, 1] and id(late) not in seen
    assert late.uid >= 0 and engine.num_running == 3
    got = _tokens(engine, [*first, late], seen)
    assert [len(got[id(s)]) for s in (*first, late)] == [6, 6, 6]
    alone = _seq(engine, "winter morning in the library")
    assert _tokens(engine, [alone])[id(alone)] == got[id(late)]


def test_a_newcomer_waits_while_the_prefilled_group_joins_then_forms_its_own(tiny_llama):
    """mlx-lm's path: the step after a group's prefill moves that group into the decode
    batch; a newcomer arriving then stays out of mlx-lm's prompt batch for that step and
    is prefilled in the next one, alone in a clean group."""
    engine = _bound(
        LLMEngine(
            "tiny",
            tiny_llama,
            TextEngineOptions(max_num_seqs=8, prefix_cache_bytes=0, clean_prefill_groups=True),
        ),
        prompt_end=False,
    )
    seen: dict[int, list[int]] = {}
    first = [_seq(engine, "the river runs"), _seq(engine, "a city of music")]
    _step(engine, seen)  # admitted and prefilled up to their last tokens
    prompting = engine._gen._currently_processing
    assert len(prompting) == 2 and all(
        rows[0] == [rows[0][0]] and len(rows[0][0]) == 1 for rows in prompting
    )
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


@pytest.mark.parametrize("prompt_end", [True, False])
def test_a_prompt_mid_prefill_holds_nobody(tiny_llama, prompt_end):
    """A prompt longer than a prefill chunk is still being prefilled: newcomers join it."""
    engine = _bound(
        LLMEngine(
            "tiny",
            tiny_llama,
            TextEngineOptions(
                max_num_seqs=8,
                prefill_step_size=16,
                prefix_cache_bytes=0,
                clean_prefill_groups=True,
            ),
        ),
        prompt_end,
    )
    long = _seq(engine, " ".join(["ocean garden market"] * 20))
    seen: dict[int, list[int]] = {}
    _step(engine, seen)  # the first 16-token chunk
    assert any(len(rows[0][0]) > 1 for rows in engine._gen._currently_processing)
    late = _seq(engine, "a short one")
    _step(engine, seen)
    assert late.uid >= 0  # inserted at once, prefilled beside the long prompt's next chunk
    got = _tokens(engine, [long, late], seen)
    assert len(got[id(late)]) == 6 and len(got[id(long)]) == 6


@pytest.mark.parametrize("prompt_end", [True, False])
def test_mlx_lm_gets_no_more_than_one_prefill_group_at_a_time(tiny_llama, groups, prompt_end):
    """Twelve at once with a prefill batch of 8: eight go in as one group, four wait here
    (not in mlx-lm's own queue, whence they would be merged into the first group's
    joining step), and go in as the next clean group once the first has joined: in the
    next step when the group joined in its prefill step, the one after on mlx-lm's path."""
    engine = _bound(
        LLMEngine(
            "tiny",
            tiny_llama,
            TextEngineOptions(max_num_seqs=16, prefix_cache_bytes=0, clean_prefill_groups=True),
        ),
        prompt_end,
    )
    seen: dict[int, list[int]] = {}
    seqs = [_seq(engine, f"story {i} of the ocean") for i in range(12)]
    _step(engine, seen)
    assert [sorted(g) for g in groups] == [sorted(s.uid for s in seqs[:8])]
    assert len(engine._gen._unprocessed_sequences) == 0
    assert engine._pending == seqs[8:]
    if not prompt_end:
        _step(engine, seen)  # the first group joins; the rest still wait
        assert engine.num_running == 8 and engine._pending == seqs[8:]
    _step(engine, seen)
    assert engine.num_running == 8 + 4 * prompt_end and engine._pending == []
    assert groups[1:] == [[s.uid for s in seqs[8:]]]
    got = _tokens(engine, seqs, seen)
    assert all(len(got[id(s)]) == 6 for s in seqs)


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU's defaults")
def test_on_the_cpu_mlx_lm_groups_newcomers_itself(tiny_llama):
    """The CPU default: every newcomer goes to mlx-lm at once, as before clean groups."""
    engine = LLMEngine("tiny", tiny_llama, TextEngineOptions(max_num_seqs=16, prefix_cache_bytes=0))
    engine.bind()
    assert not engine._clean_groups  # the tests run on the CPU
    seen: dict[int, list[int]] = {}
    seqs = [_seq(engine, f"story {i} of the ocean") for i in range(12)]
    _step(engine, seen)
    assert engine._pending == [] and all(s.uid >= 0 for s in seqs)
    got = _tokens(engine, seqs, seen)
    assert all(len(got[id(s)]) == 6 for s in seqs)


def test_an_idle_batch_takes_a_burst_as_one_group(engine, groups, monkeypatch):
    """With nothing running, a newcomer waits while a burst still arrives (the last came
    less than BURST_GAP_S ago, the first at most two decode steps or 25 ms ago), so that
    clients starting together are prefilled together; a lone newcomer goes once the gap
    has passed."""
    from types import SimpleNamespace

    from mlxd.engines import llm

    now = [1000.0]
    monkeypatch.setattr(
        llm, "time", SimpleNamespace(monotonic=lambda: now[0], perf_counter=time.perf_counter)
    )
    gap = llm.BURST_GAP_S
    engine._step_ema = 0.010  # a 10 ms decode step: held at most 20 ms

    def arrive(text: str):
        s = engine.new_sequence(
            engine.encode_prompt(text), SamplingParams(max_tokens=4, temperature=0.0)
        )
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
    assert [sorted(g) for g in groups] == [sorted(s.uid for s in burst)]

    _tokens(engine, burst, {})
    engine._step_ema = 0.010  # (the steps just run moved it)
    # once the gap has passed, a lone newcomer goes alone
    lone = arrive("just me")
    assert not engine.has_work()
    now[0] += gap
    assert engine.has_work()
    engine.step()
    assert groups[-1] == [lone.uid] and len(groups) == 2


def test_a_burst_that_never_pauses_is_held_no_longer_than_the_cap(tiny_llama, groups, monkeypatch):
    """Arrivals closer than the gap for longer than the cap (two decode steps): the first
    has waited the cap, and everything that came goes in as one group."""
    from types import SimpleNamespace

    from mlxd.engines import llm

    engine = _bound(
        LLMEngine(
            "tiny",
            tiny_llama,
            TextEngineOptions(
                max_num_seqs=16,
                prefill_batch_size=16,
                prefix_cache_bytes=0,
                clean_prefill_groups=True,
            ),
        )
    )
    now = [1000.0]
    monkeypatch.setattr(
        llm, "time", SimpleNamespace(monotonic=lambda: now[0], perf_counter=time.perf_counter)
    )
    engine._step_ema = 0.010  # the cap: two decode steps, 20 ms
    seqs = []
    for i in range(10):  # one every 2 ms for 18 ms
        if i:
            now[0] += 0.002
        seqs.append(
            engine.new_sequence(engine.encode_prompt(f"story {i}"), SamplingParams(max_tokens=2))
        )
        engine.add(seqs[-1])
        assert not engine.has_work()
    now[0] = 1000.0205  # 20 ms after the first, 2.5 after the last
    assert engine.has_work()
    engine.step()
    assert [sorted(g) for g in groups] == [sorted(s.uid for s in seqs)]


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU's defaults")
def test_on_the_cpu_an_idle_batch_takes_a_newcomer_at_once(tiny_llama):
    """The CPU default (no clean groups): no burst wait, as before."""
    engine = LLMEngine("tiny", tiny_llama, TextEngineOptions(max_num_seqs=4, prefix_cache_bytes=0))
    engine.bind()
    seq = engine.new_sequence(engine.encode_prompt("now"), SamplingParams(max_tokens=2))
    engine.add(seq)
    assert engine.has_work() and engine.next_deadline() == 0.0


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_a_hybrid_models_batch_on_the_gpus_path(tmp_path, monkeypatch, arch):
    """A GPU's defaults (clean prefill groups, finished rows held, the warm-up at every
    batch shape) on a model with recurrent or sliding-window layers: those layers join a
    running batch through mlx-lm's own extend (only plain KV layers go into row pools),
    and each sequence decodes what it decodes alone."""
    from mlxd.engines import llm

    monkeypatch.setattr(llm, "compiles_per_shape", lambda: True)
    engine = LLMEngine(
        "tiny",
        make_tiny_hybrid_model(tmp_path / arch, arch),
        TextEngineOptions(max_num_seqs=8, clean_prefill_groups=True, defer_leaves=True),
    )
    engine.bind()
    engine.warmup()
    texts = {"the river runs": 3, "a city of music": 6, "winter morning in the library": 6}
    seen: dict[int, list[int]] = {}
    seqs = [_seq(engine, t, n) for t, n in list(texts.items())[:2]]
    _step(engine, seen)
    _step(engine, seen)
    seqs.append(_seq(engine, "winter morning in the library"))  # joins the running batch
    got = _tokens(engine, seqs, seen)
    assert [len(got[id(s)]) for s in seqs] == list(texts.values())
    for s, (text, n) in zip(seqs, texts.items(), strict=True):
        alone = _seq(engine, text, n)
        assert _tokens(engine, [alone])[id(alone)] == got[id(s)]
