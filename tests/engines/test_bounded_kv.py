"""max_kv_size for text models (engines/bounded_kv.py): a Llama (whose ``make_cache``
made mlx-lm drop the bound) gets rotating caches in the batch, its KV bytes stop growing at
the bound, and the batch still gives each row what it gives that row alone."""

from __future__ import annotations

import pytest

from mlxd.core.types import SamplingParams
from mlxd.engines.llm import LLMEngine
from mlxd.engines.options import TextEngineOptions

BOUND = 64


def _run(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int
) -> tuple[list[list[int]], set[str], int]:
    """Generate greedily; (tokens per prompt, the batch's cache classes, peak KV bytes
    once every row is decoding)."""
    seqs = [
        engine.new_sequence(p, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        for p in prompts
    ]
    out: dict[int, list[int]] = {id(s): [] for s in seqs}
    for s in seqs:
        s.handle = None
        engine.add(s)
        s.t_added = 0.0  # no coalescing delay
    classes: set[str] = set()
    peak = 0
    for _ in range(1000):
        if not engine.has_work():
            break
        for seq, ev in engine.step():
            assert ev.error is None, ev.error
            if ev.token is not None:
                out[id(seq)].append(ev.token)
        if all(s.generated > 2 for s in seqs):
            classes |= {type(c).__name__ for c in engine._gen._generation_batch.prompt_cache}
            peak = max(peak, engine.memory_bytes()["kv_cache"])
    return [out[id(s)] for s in seqs], classes, peak


@pytest.fixture(scope="module")
def engines(tiny_llama):
    bounded = LLMEngine("b", tiny_llama, TextEngineOptions(max_kv_size=BOUND, max_num_seqs=8))
    plain = LLMEngine("p", tiny_llama, TextEngineOptions(max_num_seqs=8))
    bounded.bind()  # the batch, as the device thread builds it at load
    plain.bind()
    yield bounded, plain
    bounded.close()
    plain.close()


def test_the_bound_holds_in_a_batch(engines):
    bounded, plain = engines
    assert hasattr(bounded.model, "make_cache")  # the case mlx-lm's own bound skipped
    long = bounded.encode_prompt("the quick brown fox jumps over the lazy dog " * 8)
    assert len(long) > 2 * BOUND
    prompts = [long, long[: BOUND + 10], bounded.encode_prompt("Hi")]
    toks, classes, peak = _run(bounded, prompts, 60)
    _, plain_classes, plain_peak = _run(plain, prompts, 60)
    assert classes == {"BatchRotatingKVCache"} and "BatchRotatingKVCache" not in plain_classes
    assert all(len(t) == 60 for t in toks)
    assert peak < plain_peak / 2
    # each row decodes in the batch as it does alone
    for p, t in zip(prompts, toks, strict=True):
        assert _run(bounded, [p], 60)[0][0] == t


def test_below_the_bound_nothing_changes(engines):
    bounded, plain = engines
    prompt = bounded.encode_prompt("Hello there")
    n = BOUND - len(prompt) - 1
    assert _run(bounded, [prompt], n)[0] == _run(plain, [prompt], n)[0]
