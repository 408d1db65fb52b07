"""Decode rows and a prompt's prefill chunk in one forward pass (engine.mixed_steps).

mlx-lm's batch runs a step's decode rows and its prefill chunks as separate forward
passes, each of which reads every weight of the model. Beside running streams that is
the cost that makes a long prompt's prefill slow or the streams stall: on a 2-core CPU a
SmolLM2-135M decode step of 8 rows costs about what 40 prompt tokens do, so a prompt
prefilled in chunks small enough to keep the streams' pace waits one whole decode step
per chunk (docs/benchmarks.md, a long prompt beside running streams). vLLM's scheduler
feeds both in one pass; so does this step, without rewriting the model:

- the step's tokens are laid out as rows of one token each, ``[decode rows + prompt
  tokens, 1]``: every projection, norm and MLP sees them as one batch (one read of the
  weights), and rotary embeddings take one position per row (the cache's ``offset``);
- each layer's cache is a :class:`MixedCache` over the decode batch's cache and the prompt
  batch's: it hands each part's keys and values to its own cache, and, since it has the
  attributes mlx-lm's attention looks for on a quantized cache (``bits``), mlx-lm's
  ``scaled_dot_product_attention`` hands attention to this module's function
  (:func:`mixed_attention`), which attends each part over its own cache with its own
  mask, as mlx-lm would in two passes;
- only the decode rows' positions and each prompt's last position (when its prefill ends
  in this chunk) go through the final norm and LM head (engines/prompt_end.py's layout).

Which models this holds for is checked, not assumed: :func:`supports_mixed_steps` runs a
decode row and a prompt chunk both ways at load, and any difference or error keeps
separate passes. Layers that are not plain KV (sliding windows, recurrent state) never
mix.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx_lm.models.base as mlx_lm_base
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from mlxd.engines import kv_quant  # noqa: F401 - its attention goes in first, this wraps it
from mlxd.engines.kv_quant import QuantizedBatchKVCache
from mlxd.engines.kv_rows import RowPoolKVCache
from mlxd.engines.lora import set_rows
from mlxd.engines.prompt_end import decoder, final_norm_over

log = logging.getLogger(__name__)

# the layer caches a mixed step can carry, on either side
MIXABLE = (BatchKVCache, RowPoolKVCache, QuantizedBatchKVCache)
# the most prompt tokens a step mixes: on a CPU a tiny model's 512-token chunk and 8 decode
# rows cost 1.7x in one pass what they cost in two, SmolLM2-135M's 32-128-token chunks
# 0.87-0.97x (benchmarks/mixed_pass.py)
MOST_MIXED_TOKENS = 128


class MixedKV(tuple):
    """A layer's keys (or values) through this step: the decode part's and the prompt
    part's, as their caches fetched them, and the cache that split them."""

    cache: MixedCache


class MixedMask:
    """The decode part's mask and the prompt part's, from their own caches."""

    __slots__ = ("decode", "prompt")

    def __init__(self, decode: Any, prompt: Any) -> None:
        self.decode, self.prompt = decode, prompt


class MixedCache:
    """One layer's view of a mixed step: ``decode`` rows of ``steps`` tokens each (one,
    or a verify step's token and drafts) first, then ``prompts`` rows of ``chunk``
    tokens, each part over its own cache (``decode``, ``prompt``)."""

    bits = 0  # mlx-lm's attention sends a cache with ``bits`` to the quantized function
    group_size = 0

    def __init__(
        self, decode: Any, prompt: Any, shape: tuple[int, int, int, int], offset: mx.array
    ) -> None:
        self.decode, self.prompt = decode, prompt
        self.rows, self.steps, self.prompts, self.chunk = shape
        self.offset = offset  # every token's position (:func:`positions`)

    def make_mask(self, n: int, *, return_array: bool = False, **kwargs: Any) -> MixedMask:
        return MixedMask(
            self.decode.make_mask(self.steps, return_array=return_array, **kwargs),
            self.prompt.make_mask(self.chunk, return_array=return_array, **kwargs),
        )

    def split(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """``[rows * steps + prompts * chunk, heads, 1, dim]`` as the decode part ``[rows,
        heads, steps, dim]`` and the prompt part ``[prompts, heads, chunk, dim]``."""
        n = self.rows * self.steps
        return (
            _unflat(x[:n], self.rows, self.steps),
            _unflat(x[n:], self.prompts, self.chunk),
        )

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[MixedKV, MixedKV]:
        kd, kp = self.split(keys)
        vd, vp = self.split(values)
        dk, dv = self.decode.update_and_fetch(kd, vd)
        pk, pv = self.prompt.update_and_fetch(kp, vp)
        k, v = MixedKV((dk, pk)), MixedKV((dv, pv))
        k.cache = v.cache = self
        return k, v


def _unflat(x: mx.array, rows: int, length: int) -> mx.array:
    """``[rows * length, heads, 1, dim]`` as ``[rows, heads, length, dim]``."""
    return x.reshape(rows, length, x.shape[1], x.shape[3]).transpose(0, 2, 1, 3)


def _flat(x: mx.array) -> mx.array:
    """``[rows, heads, length, dim]`` as ``[rows * length, heads, 1, dim]``."""
    return x.transpose(0, 2, 1, 3).reshape(-1, x.shape[1], 1, x.shape[3])


def positions(decode: Any, prompt: Any, shape: tuple[int, int, int, int]) -> mx.array:
    """Each token's position in its sequence, as a mixed step lays them out (``shape``:
    decode rows, their tokens, prompts, their chunk): the same in every layer, whose
    batch caches share their rows' offsets."""
    rows, steps, prompts, chunk = shape
    parts = []
    for cache, n, length in ((decode, rows, steps), (prompt, prompts, chunk)):
        start = mx.broadcast_to(mx.array(cache.offset), (n,))
        parts.append((start[:, None] + mx.arange(length)).reshape(-1))
    return mx.concatenate(parts)


_PREVIOUS_ATTENTION = mlx_lm_base.quantized_scaled_dot_product_attention


def mixed_attention(
    queries: mx.array,
    q_keys: Any,
    q_values: Any,
    scale: float,
    mask: Any,
    group_size: int = 64,
    bits: int = 8,
) -> mx.array:
    """Attention of a mixed step: each part over its own cache, as mlx-lm's attention
    runs it (a quantized part through its own function); the outputs laid out as the
    queries came. Anything else goes to the function this one wraps."""
    if not isinstance(q_keys, MixedKV):
        return _PREVIOUS_ATTENTION(queries, q_keys, q_values, scale, mask, group_size, bits)
    keys, values, cache = q_keys, q_values, q_keys.cache
    qd, qp = cache.split(queries)
    masks = mask if isinstance(mask, MixedMask) else MixedMask(None, "causal")
    attend = mlx_lm_base.scaled_dot_product_attention
    od = attend(qd, keys[0], values[0], cache=cache.decode, scale=scale, mask=masks.decode)
    op = attend(qp, keys[1], values[1], cache=cache.prompt, scale=scale, mask=masks.prompt)
    return mx.concatenate([_flat(od), _flat(op)])


mlx_lm_base.quantized_scaled_dot_product_attention = mixed_attention


def mixed_forward(
    model: Any,
    decode_inputs: mx.array,
    decode_cache: list[Any],
    decode_uids: list[int],
    chunks: mx.array,
    prompt_cache: list[Any],
    prompt_uids: list[int],
    prompt_logits: bool,
) -> tuple[mx.array, mx.array | None]:
    """One forward pass over the decode rows' tokens (``decode_inputs``: ``[rows,
    steps]``) and the prompts' chunks (``[prompts, chunk]``), filling both caches.
    Returns the decode rows' logits ``[rows, steps, vocab]`` and, with ``prompt_logits``,
    each prompt's logits at its chunk's last position ``[prompts, vocab]``."""
    rows, steps = decode_inputs.shape
    prompts, chunk = chunks.shape
    tokens = mx.concatenate([decode_inputs.reshape(-1), chunks.reshape(-1)])[:, None]
    shape = (rows, steps, prompts, chunk)
    offset = positions(decode_cache[0], prompt_cache[0], shape)
    caches = [
        MixedCache(d, p, shape, offset) for d, p in zip(decode_cache, prompt_cache, strict=True)
    ]
    set_rows(
        model,
        [u for u in decode_uids for _ in range(steps)]
        + [u for u in prompt_uids for _ in range(chunk)],
    )
    n = rows * steps
    picked = list(range(n))
    if prompt_logits:
        picked += [n + (i + 1) * chunk - 1 for i in range(prompts)]
    index = mx.array(picked)
    with final_norm_over(model, lambda h: h[index]):
        logits = model(tokens, cache=caches)[:, -1, :]  # [picked, vocab]
    last = logits[n:] if prompt_logits else None
    return logits[:n].reshape(rows, steps, -1), last


def mixable(caches: list[Any]) -> bool:
    """Whether every layer's cache can be one side of a mixed step."""
    return bool(caches) and all(isinstance(c, MIXABLE) for c in caches)


def supports_mixed_steps(model: Any) -> bool:
    """Whether :func:`mixed_forward` gives what separate passes give for this model: two
    decode rows of different lengths (one left-padded) with two tokens each, and a 4-token
    prompt chunk over a cached prefix, both ways, compared (logits and caches). False for
    any doubt."""
    if decoder(model) is None or not all(type(c) is KVCache for c in make_prompt_cache(model)):
        return False
    try:
        n = len(make_prompt_cache(model))

        def batch(rows: list[list[int]], padding: list[int]) -> list[Any]:
            caches = [BatchKVCache(padding) for _ in range(n)]
            model(mx.array(rows), cache=caches)
            return caches

        steps, chunk = mx.array([[8, 11], [10, 12]]), mx.array([[1, 2, 3, 4]])
        decoding, prompt = ([[5, 6, 7], [0, 0, 9]], [0, 2]), ([[20, 21]], [0])
        dec_a, pro_a = batch(*decoding), batch(*prompt)
        alone = model(steps, cache=dec_a)
        chunk_alone = model(chunk, cache=pro_a)[:, -1, :]
        dec_b, pro_b = batch(*decoding), batch(*prompt)
        mixed, last = mixed_forward(model, steps, dec_b, [0, 1], chunk, pro_b, [2], True)
        assert last is not None
        pairs = [(alone, mixed), (chunk_alone, last)]
        for a, b in zip(dec_a + pro_a, dec_b + pro_b, strict=True):
            pairs.append((a.keys[..., : a._idx, :], b.keys[..., : b._idx, :]))
        same = all(
            a.shape == b.shape
            and bool(mx.allclose(a.astype(mx.float32), b.astype(mx.float32), rtol=1e-2, atol=1e-2))
            for a, b in pairs
        )
    except Exception:  # noqa: BLE001 - a layout this does not know: separate passes
        log.debug("mixed decode and prefill steps: not for this model", exc_info=True)
        return False
    if not same:
        log.info("mixed decode and prefill steps: off for this model (outputs differ)")
    return same
