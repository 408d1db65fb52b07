"""Decode rows and prefill chunks in one forward pass (engines/mixed_step.py): the same
greedy tokens as separate passes, with plain, quantized and speculative batches."""

from __future__ import annotations

import mlx.core as mx
import pytest
from fixtures.hybrid_models import HYBRID_ARCHS, make_tiny_hybrid_model
from fixtures.lora import make_lora_adapter
from fixtures.tiny_models import SUPPORTED_ARCHS, make_tiny_chat_model
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.utils import load

from mlxd.core.types import SamplingParams
from mlxd.engines.kv_quant import KVQuant
from mlxd.engines.llm import LLMEngine
from mlxd.engines.lora import RowAdapters, read_adapter
from mlxd.engines.mixed_step import (
    MOST_MIXED_TOKENS,
    MixedCache,
    mixed_forward,
    supports_mixed_steps,
)
from mlxd.engines.options import TextEngineOptions
from mlxd.engines.serving_batch import ServingBatchGenerator


@pytest.fixture(scope="module", params=SUPPORTED_ARCHS)
def arch_model(request, tmp_path_factory):
    path = make_tiny_chat_model(tmp_path_factory.mktemp(request.param), request.param)
    return load(str(path))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """Heads 64 wide: mx.quantize's smallest group is 32."""
    path = make_tiny_chat_model(
        tmp_path_factory.mktemp("m") / "wide", "llama", hidden_size=128, head_dim=64
    )
    return load(str(path))


def _caches(model, rows: list[list[int]]) -> list[BatchKVCache]:
    """A batch cache per layer holding ``rows`` (left-padded to one length)."""
    longest = max(map(len, rows))
    pad = [longest - len(r) for r in rows]
    caches = [BatchKVCache(pad) for _ in model.layers]
    model(mx.array([[0] * p + r for p, r in zip(pad, rows, strict=True)]), cache=caches)
    return caches


def test_one_pass_gives_what_two_passes_give(arch_model):
    """Two decode rows of different lengths (one left-padded) with two tokens each (a
    verify step's shape) and two prompts' 5-token chunks, one of them over a cached
    prefix: logits of every decode position and each prompt's last, and every cache
    written, as the decode pass and the prefill pass give them."""
    model, _ = arch_model
    assert supports_mixed_steps(model)
    decode_rows, steps = [[5, 6, 7, 8, 9], [10, 11]], mx.array([[12, 13], [14, 15]])
    prompt_rows = [[20, 21, 22], [23, 24, 25]]
    chunks = mx.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    dec, pro = _caches(model, decode_rows), _caches(model, prompt_rows)
    want = model(steps, cache=dec)
    want_last = model(chunks, cache=pro)[:, -1, :]
    dec2, pro2 = _caches(model, decode_rows), _caches(model, prompt_rows)
    got, last = mixed_forward(model, steps, dec2, [1, 2], chunks, pro2, [3, 4], True)
    assert last is not None
    assert mx.allclose(got, want, atol=1e-4).item()
    assert mx.allclose(last, want_last, atol=1e-4).item()
    for a, b in zip(dec + pro, dec2 + pro2, strict=True):
        assert a._idx == b._idx and a.offset.tolist() == b.offset.tolist()
        assert mx.allclose(a.keys[..., : a._idx, :], b.keys[..., : b._idx, :], atol=1e-4).item()
        assert mx.allclose(a.values[..., : a._idx, :], b.values[..., : b._idx, :], atol=1e-4).item()


@pytest.mark.parametrize("part", ["decode", "prompt"])
def test_the_check_at_load_catches_a_pass_that_loses_a_mask(llama, monkeypatch, part):
    """A model whose mixed pass would attend without the decode rows' padding mask, or
    without the prompt's causal mask, fails the check (and keeps separate passes)."""
    model, _ = llama
    assert supports_mixed_steps(model)
    real = MixedCache.make_mask

    def lossy(self, n, **kwargs):
        masks = real(self, n, **kwargs)
        setattr(masks, part, None)
        return masks

    monkeypatch.setattr(MixedCache, "make_mask", lossy)
    assert not supports_mixed_steps(model)


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_models_with_other_layers_keep_separate_passes(tmp_path, arch):
    model, _ = load(str(make_tiny_hybrid_model(tmp_path / arch, arch)))
    assert not supports_mixed_steps(model)


def _greedy(gen, prompts: list[list[int]], late: list[list[int]], n: int = 10):
    """Greedy tokens per prompt: ``prompts`` first, ``late`` once the first ones decode."""
    uids = gen.insert(prompts, max_tokens=[n] * len(prompts))
    out: dict[int, list[int]] = {u: [] for u in uids}
    inserted = False
    for _ in range(400):
        _, responses = gen.next()
        for r in responses:
            out[r.uid].append(r.token)
        if not inserted and responses:
            for u in gen.insert(late, max_tokens=[n] * len(late)):
                out[u] = []
            inserted = True
        if inserted and all(len(v) == n for v in out.values()):
            break
    return list(out.values())


@pytest.mark.parametrize("kv_bits", [None, 8])
@pytest.mark.parametrize("budget", [0, 40])
def test_a_mixed_batch_decodes_what_separate_passes_do(llama, budget, kv_bits):
    """Rows decoding while long prompts arrive (two at once, of different lengths, then
    one alone): the same greedy tokens with mixed steps as without, and steps did mix."""
    model, tok = llama
    prompts = [tok.encode("the river runs to the sea"), tok.encode("a city")]
    late = [
        tok.encode(" ".join(["ocean garden market"] * 14)),
        tok.encode(" ".join(["winter morning"] * 30)),
    ]
    q = KVQuant(bits=kv_bits) if kv_bits else None
    kw = dict(
        prefill_step_size=32,
        completion_batch_size=8,
        prefill_batch_size=4,
        prompt_end=True,
        max_step_tokens=budget,
        kv_quant=q,
    )
    apart = _greedy(ServingBatchGenerator(model, **kw), prompts, late)
    gen = ServingBatchGenerator(model, mixed=True, **kw)
    assert _greedy(gen, prompts, late) == apart
    assert all(len(t) == 10 for t in apart)
    assert gen.step_stats.mixed_steps > 0


def test_per_row_adapters_apply_to_each_token_of_a_mixed_pass(tmp_path):
    """Rows decoding with one LoRA adapter and none while a prompt with another is
    prefilled: every row's tokens are what separate passes give, and steps did mix."""
    path = make_tiny_chat_model(tmp_path / "m", "llama", hidden_size=128, head_dim=64)
    model, tok = load(str(path))
    rows = RowAdapters(model, lambda name: False)
    for i, name in enumerate(("alpha", "beta")):
        rows.load(read_adapter(name, make_lora_adapter(path, tmp_path / name, seed=i)))

    def run(mixed: bool) -> list[list[int]]:
        gen = ServingBatchGenerator(
            model, mixed=mixed, prefill_step_size=16, prompt_end=True, max_step_tokens=24
        )
        uids = gen.insert([tok.encode("the river"), tok.encode("a city")], max_tokens=[12] * 2)
        rows.admit(uids[0], "alpha")
        out: dict[int, list[int]] = {u: [] for u in uids}
        for _ in range(200):
            _, responses = gen.next()
            for r in responses:
                out[r.uid].append(r.token)
            if len(out) == 2 and responses:
                (late,) = gen.insert([tok.encode(" ".join(["winter morning"] * 20))], [12])
                rows.admit(late, "beta")
                out[late] = []
            if len(out) == 3 and all(len(v) == 12 for v in out.values()):
                break
        assert gen.step_stats.mixed_steps > 0 if mixed else True
        for u in out:
            rows.release(u)
        return list(out.values())

    apart = run(False)
    assert run(True) == apart
    assert len({tuple(t) for t in apart}) == 3


def test_chunks_longer_than_the_mixing_bound_go_in_passes_of_their_own(llama):
    """A step whose prompts bring more than MOST_MIXED_TOKENS tokens prefills them in a
    pass of its own: the same tokens, and no step mixed."""
    model, tok = llama
    prompts = [tok.encode("the river runs to the sea")]
    late = [tok.encode(" ".join(["ocean garden market"] * 90))]
    assert len(late[0]) > 2 * MOST_MIXED_TOKENS
    kw = dict(prefill_step_size=2 * MOST_MIXED_TOKENS, prompt_end=True)
    apart = _greedy(ServingBatchGenerator(model, **kw), prompts, late)
    gen = ServingBatchGenerator(model, mixed=True, **kw)
    assert _greedy(gen, prompts, late) == apart
    assert gen.step_stats.mixed_steps == 0


def test_a_speculative_engine_mixes_its_verify_steps_alike(tiny_llama):
    """Prompt lookup verifying drafts while a long prompt prefills: mixed steps carry
    verify steps' drafts, and greedy output is what separate passes give."""
    texts = [
        " ".join(["ocean garden market"] * 8),
        "the river runs to the sea " * 3,
    ]
    long = " ".join(["winter morning library"] * 40)
    got, mixed = [], []
    for mix in (False, True):
        engine = LLMEngine(
            "tiny",
            tiny_llama,
            TextEngineOptions(
                max_num_seqs=4,
                prefix_cache_bytes=0,
                speculative="prompt-lookup",
                speculative_policy="always",
                max_step_tokens=24,
                mixed_steps=mix,
            ),
        )
        engine.bind()
        seqs = [
            engine.new_sequence(
                engine.encode_prompt(t), SamplingParams(max_tokens=40, temperature=0.0)
            )
            for t in texts
        ]
        for s in seqs:
            engine.add(s)
        out: dict[int, list[int]] = {id(s): [] for s in seqs}
        for step in range(600):
            if step == 3:
                s = engine.new_sequence(
                    engine.encode_prompt(long), SamplingParams(max_tokens=8, temperature=0.0)
                )
                engine.add(s)
                seqs.append(s)
                out[id(s)] = []
            if step > 3 and all(s.finished for s in seqs):
                break
            for seq, ev in engine.step():
                assert ev.error is None
                if ev.token is not None:
                    out[id(seq)].append(ev.token)
        got.append([out[id(s)] for s in seqs])
        mixed.append((engine._gen.step_stats.mixed_steps, engine.speculator.stats.verify_steps))
    assert got[0] == got[1]
    assert [len(t) for t in got[1]] == [40, 40, 8]
    assert mixed[0][0] == 0
    assert mixed[1][0] > 0 and mixed[1][1] > 0
