"""Per-sequence samplers and logits processors built from protocol-free SamplingParams.

The filters are plain (uncompiled) MLX ops on purpose: mlx-lm's samplers are ``mx.compile``d
with the temperature as a constant, so every new temperature and every new batch shape
traces again, which on the CPU stalls a request for one to two seconds. Uncompiled, a row
costs about a millisecond (a top-p sort a few more).

Greedy requests share the batch's one greedy sampler and unseeded requests with equal
parameters share one sampler object, because mlx-lm's batch samples all rows in one call
only when every row holds the *same* sampler object. Seeded requests get a sampler with a
private PRNG key, so a seed gives the same text whatever else shares the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors

from mlxd.core.types import SamplingParams

Sampler = Callable[[mx.array], mx.array]
_NEG_INF = float("-inf")
_KEY_SPACE = 2**64  # mx.random.key takes a uint64; anything else raises inside the batch


def prng_key(seed: int) -> mx.array:
    """The PRNG key of a seed: any Python int maps onto MLX's uint64 domain, so no seed can
    make key() raise while the batch is decoding (negative seeds included)."""
    return mx.random.key(seed % _KEY_SPACE)


def _top_k(logprobs: mx.array, k: int) -> mx.array:
    drop = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[..., k:]
    return mx.put_along_axis(logprobs, drop, mx.array(_NEG_INF, logprobs.dtype), axis=-1)


def _top_p(logprobs: mx.array, p: float) -> mx.array:
    order = mx.argsort(-logprobs, axis=-1)
    sorted_lp = mx.take_along_axis(logprobs, order, axis=-1)
    cum = mx.cumsum(mx.exp(sorted_lp), axis=-1)
    # Keep a token if the mass before it is still below p: the top token always survives.
    keep = (cum - mx.exp(sorted_lp)) < p
    kept = mx.where(keep, sorted_lp, _NEG_INF)
    return mx.put_along_axis(
        mx.full(logprobs.shape, _NEG_INF, logprobs.dtype), order, kept, axis=-1
    )


def _min_p(logprobs: mx.array, p: float) -> mx.array:
    threshold = mx.max(logprobs, axis=-1, keepdims=True) + mx.log(mx.array(p))
    return mx.where(logprobs >= threshold, logprobs, _NEG_INF)


def _filters(params: SamplingParams, vocab_size: int) -> list[Callable[[mx.array], mx.array]]:
    filters: list[Callable[[mx.array], mx.array]] = []
    if 0 < params.top_k < vocab_size:
        filters.append(lambda x: _top_k(x, params.top_k))
    if 0.0 < params.top_p < 1.0:
        filters.append(lambda x: _top_p(x, params.top_p))
    if params.min_p > 0.0:
        filters.append(lambda x: _min_p(x, params.min_p))
    return filters


def sampling_probs(params: SamplingParams, vocab_size: int) -> Callable[[mx.array], mx.array]:
    """The distribution a sampled row's sampler draws from (filters, then temperature), as
    probabilities over the last axis: speculative verification (engines/speculative.py)
    needs the distribution itself, not one draw from it."""
    filters = _filters(params, vocab_size)
    inv_temp = 1.0 / params.temperature

    def probs(logprobs: mx.array) -> mx.array:
        for f in filters:
            logprobs = f(logprobs)
        return mx.softmax(logprobs * inv_temp, axis=-1)

    return probs


def _make(params: SamplingParams, vocab_size: int, key: mx.array | None) -> Sampler:
    filters = _filters(params, vocab_size)
    inv_temp = 1.0 / params.temperature
    state = {"key": key}

    def sample(logprobs: mx.array) -> mx.array:
        for f in filters:
            logprobs = f(logprobs)
        if state["key"] is None:
            return mx.random.categorical(logprobs * inv_temp)
        state["key"], sub = mx.random.split(state["key"])
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return sample


@lru_cache(maxsize=64)
def _shared(temperature: float, top_p: float, min_p: float, top_k: int, vocab: int) -> Sampler:
    params = SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p, top_k=top_k)
    return _make(params, vocab, None)


def build_sampler(params: SamplingParams, vocab_size: int) -> Sampler | None:
    """None means "the batch's greedy fallback", so greedy rows share one batched argmax."""
    if params.greedy:
        return None
    if params.seed is None:
        top_k = params.top_k if 0 < params.top_k < vocab_size else 0
        return _shared(params.temperature, params.top_p, params.min_p, top_k, vocab_size)
    return _make(params, vocab_size, prng_key(params.seed))


def build_logits_processors(params: SamplingParams) -> list:
    return make_logits_processors(
        logit_bias=params.logit_bias or None,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
    )
