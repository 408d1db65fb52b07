"""engines/serving_batch.py: the engine core's prefill decodes what mlx-lm's does, and leaves
MLX's buffer cache to the decode steps that follow it instead of clearing it per chunk."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.utils import load

from mlxd.engines import serving_batch
from mlxd.engines.serving_batch import ServingBatchGenerator


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_llama):
    model, tokenizer = load(str(tiny_llama))
    return model, tokenizer


def _run(gen, prompts: list[list[int]], late: list[int] | None = None) -> dict[int, list[int]]:
    """Greedy tokens per uid; ``late`` is inserted once the first prompts decode."""
    uids = gen.insert(prompts, max_tokens=[8] * len(prompts))
    out: dict[int, list[int]] = {u: [] for u in uids}
    inserted = late is None
    for _ in range(100):
        _, responses = gen.next()
        for r in responses:
            out[r.uid].append(r.token)
        if not inserted and responses:
            out[gen.insert([late], max_tokens=[8])[0]] = []
            inserted = True
        if inserted and all(len(v) == 8 for v in out.values()):
            break
    return out


def test_same_tokens_as_mlx_lm_across_padding_and_chunks(model_and_tokenizer):
    """Prompts of different lengths (right padding) and one longer than a prefill chunk
    (several chunks), plus a newcomer prefilled while the batch decodes."""
    model, tok = model_and_tokenizer
    prompts = [tok.encode("the river runs to the sea"), tok.encode("a city"),
               tok.encode(" ".join(["ocean garden market"] * 12))]
    late = tok.encode("winter morning in the library")
    kw = dict(max_tokens=8, prefill_step_size=16, completion_batch_size=8,
              prefill_batch_size=4)
    ours = _run(ServingBatchGenerator(model, **kw), prompts, late)
    theirs = _run(BatchGenerator(model, **kw), prompts, late)
    assert list(ours.values()) == list(theirs.values())
    assert all(len(v) == 8 for v in ours.values())


def test_a_prefill_beside_a_running_batch_keeps_the_buffer_cache(model_and_tokenizer,
                                                                 monkeypatch):
    model, tok = model_and_tokenizer
    cached = {}
    for cls in (BatchGenerator, ServingBatchGenerator):
        gen = cls(model, max_tokens=8, prefill_step_size=8)
        gen.insert([tok.encode("the river runs to the sea")], max_tokens=[30])
        for _ in range(4):
            gen.next()  # prefilled, decoding
        gen.insert([tok.encode("a city of music and light")], max_tokens=[30])
        gen.next()  # decode step, then the newcomer's prefill (mlx-lm clears after it)
        cached[cls] = mx.get_cache_memory()
        mx.clear_cache()
    # mlx-lm's leaves only what was freed after its clear (a few bytes); ours the step's
    # buffers, for the next decode step to reuse
    assert cached[BatchGenerator] < 1024 < 16 * 1024 < cached[ServingBatchGenerator], cached
    # over the bound, the cache is cleared after all
    gen = ServingBatchGenerator(model, max_tokens=8, prefill_step_size=8)
    gen.insert([tok.encode("the river runs to the sea")], max_tokens=[30])
    gen.next()
    assert mx.get_cache_memory() > 0
    held = mx.get_cache_memory()
    serving_batch.trim_buffer_cache()  # under the bound: kept
    assert mx.get_cache_memory() == held
    monkeypatch.setattr(serving_batch, "CACHE_KEEP_BYTES", held - 1)
    serving_batch.trim_buffer_cache()  # over it: cleared
    assert mx.get_cache_memory() == 0


def test_the_engine_clears_the_buffer_cache_when_its_batch_runs_dry(tiny_llama):
    """Memory at rest is what mlx-lm leaves: the cache kept for decode steps is handed back
    once the last sequence has finished."""
    from mlxd.core.types import SamplingParams
    from mlxd.engines.llm import LLMEngine

    engine = LLMEngine("tiny", tiny_llama, max_num_seqs=4, prefix_cache_bytes=0)
    engine.bind()
    seq = engine.new_sequence(engine.encode_prompt("the river runs to the sea"),
                              SamplingParams(max_tokens=6, temperature=0.0))
    engine.add(seq)
    held = []
    while engine.has_work():
        engine.step()
        if not seq.finished:
            held.append(mx.get_cache_memory())
    assert seq.finished and max(held) > 0
    assert mx.get_cache_memory() == 0
