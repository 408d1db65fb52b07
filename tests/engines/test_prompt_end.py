"""engines/prompt_end.py and ``ServingBatchGenerator(prompt_end=True)``: a newcomer's first
token comes from its prefill pass, one forward pass fewer per group and a step sooner,
and everything a row emits is what mlx-lm's batch emits."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load

from mlxd.engines.bounded_kv import BoundedBatchGenerator
from mlxd.engines.prompt_end import supports_prompt_end
from mlxd.engines.serving_batch import ServingBatchGenerator


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_llama):
    model, tokenizer = load(str(tiny_llama))
    return model, tokenizer


def _second_best(logprobs: mx.array) -> mx.array:
    """A sampler of another kind than the batch's: every row's second likeliest token."""
    return mx.argsort(-logprobs, axis=-1)[:, 1]


def _run(gen, prompts, late, processors):
    """Per uid: (tokens, the first token's logprobs, the step of the first token); ``late``
    is inserted at the first step that answers."""
    samplers = [make_sampler(temp=0.0), _second_best] * (len(prompts) // 2) + [
        make_sampler(temp=0.0)
    ] * (len(prompts) % 2)
    uids = gen.insert(
        prompts, max_tokens=[6] * len(prompts), samplers=samplers, logits_processors=processors
    )
    out: dict[int, list] = {u: [[], None, None] for u in uids}
    step = 0
    while late is not None or any(len(v[0]) < 6 for v in out.values()):
        step += 1
        assert step < 100
        _, responses = gen.next()
        for r in responses:
            row = out[r.uid]
            if row[1] is None:
                row[1], row[2] = r.logprobs, step
            row[0].append(r.token)
        if responses and late is not None:
            (u,) = gen.insert([late], max_tokens=[6])
            out[u] = [[], None, None]
            late = None
    return out


def _counting_model_calls(monkeypatch, model) -> list[int]:
    """The number of rows of every forward pass of ``model``'s class."""
    calls: list[int] = []
    cls = type(model)
    real = cls.__call__
    monkeypatch.setattr(
        cls,
        "__call__",
        lambda self, x, *a, **k: (calls.append(x.shape[0]), real(self, x, *a, **k))[1],
    )
    return calls


def test_first_tokens_are_mlx_lms_with_a_pass_fewer_and_a_step_sooner(
    model_and_tokenizer, monkeypatch
):
    """Prompts of other lengths (right padding), one over three prefill chunks (it goes on
    while the others start: mlx-lm's split), a one-token prompt, a newcomer while the batch
    decodes; greedy rows and a sampler of another kind per row (mlx-lm's per-row path); a
    logits processor that records its context. Same tokens and first-token logprobs as
    mlx-lm's batch, the processors saw the same contexts, every first token came a step
    sooner, and each group ran one forward pass fewer."""
    model, tok = model_and_tokenizer
    prompts = [
        tok.encode("the river runs to the sea"),
        tok.encode("a city"),
        tok.encode(" ".join(["ocean garden market"] * 12)),
        tok.encode("x")[:1],
    ]
    late = tok.encode("winter morning in the library")
    kw = dict(max_tokens=6, prefill_step_size=16, completion_batch_size=8, prefill_batch_size=4)
    results, contexts, passes = {}, {}, {}
    for name, gen in (
        ("mlx-lm", BatchGenerator(model, **kw)),
        ("ours", ServingBatchGenerator(model, prompt_end=True, **kw)),
    ):
        seen: list[list[int]] = []

        def recording(context, logits, seen=seen):
            seen.append(context.tolist())
            return logits

        calls = _counting_model_calls(monkeypatch, model)
        results[name] = _run(gen, prompts, late, [[recording], [], [], [recording]])
        contexts[name], passes[name] = seen, len(calls)
        monkeypatch.undo()
    ours, theirs = results["ours"], results["mlx-lm"]
    assert [v[0] for v in ours.values()] == [v[0] for v in theirs.values()]
    assert all(len(v[0]) == 6 for v in ours.values())
    for uid, (_, logprobs, _) in ours.items():
        assert mx.allclose(logprobs, theirs[uid][1], atol=1e-4).item()
    # (in another order: the rows' first tokens come at other steps)
    assert sorted(contexts["ours"]) == sorted(contexts["mlx-lm"])
    assert prompts[0] in contexts["ours"]  # the whole prompt, for the first token
    # the first token a step sooner for every row, but the one-token prompt's (mlx-lm
    # starts it at once, with a pass of its own)
    sooner = {u: theirs[u][2] - ours[u][2] for u in ours}
    assert sooner == {0: 1, 1: 1, 2: 1, 3: 0, 4: 1}
    # three groups (the first, the long prompt after its chunks, the newcomer) started
    # with a pass of their own in mlx-lm's batch; here the decode steps are the same
    assert passes["mlx-lm"] - passes["ours"] >= 3


def test_a_bounded_batch_decodes_alike(model_and_tokenizer):
    """Rotating caches (max_kv_size) with prompts longer than the bound: the same tokens
    with the last prompt token in the prefill pass as in a pass of its own."""
    model, tok = model_and_tokenizer
    long = tok.encode("the quick brown fox jumps over the lazy dog " * 6)
    prompts = [long, long[:40], tok.encode("Hi")]
    assert len(long) > 64
    out = {}
    for prompt_end in (True, False):
        gen = BoundedBatchGenerator(
            model, max_kv_size=32, prompt_end=prompt_end, max_tokens=12, prefill_step_size=16
        )
        uids = gen.insert(prompts, max_tokens=[12] * 3)
        got: dict[int, list[int]] = {u: [] for u in uids}
        while any(len(v) < 12 for v in got.values()):
            for r in gen.next()[1]:
                got[r.uid].append(r.token)
        out[prompt_end] = list(got.values())
    assert out[True] == out[False]


def test_which_models_take_their_first_token_from_the_prefill(model_and_tokenizer, tiny_qwen2):
    model, _ = model_and_tokenizer
    assert supports_prompt_end(model)
    assert supports_prompt_end(load(str(tiny_qwen2))[0])

    class Unnormed(nn.Module):  # no final norm where mlx-lm's layout puts it
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 8)

        def __call__(self, x, cache=None):
            return self.proj(mx.ones((*x.shape, 4)))

    assert not supports_prompt_end(Unnormed())

    class Mixing(nn.Module):
        """A head that reads every position after the final norm: the last position's
        logits are not its own alone."""

        def __init__(self, inner):
            super().__init__()
            self.model = inner.model
            self.inner = inner

        def __call__(self, x, cache=None):
            h = self.model(x, cache)
            return self.model.embed_tokens.as_linear(h + h.mean(axis=1, keepdims=True))

        def make_cache(self):
            from mlx_lm.models.cache import make_prompt_cache

            return make_prompt_cache(self.inner)

    mixing = Mixing(model)
    assert not supports_prompt_end(mixing)
    assert type(model.model.norm) is nn.RMSNorm  # the check left the model as it was
