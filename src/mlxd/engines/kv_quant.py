"""A quantized KV cache for text models in mlx-lm's continuous batch (``engine.kv_bits``).

mlx-lm 0.32 quantizes a single stream's cache (``QuantizedKVCache``) but its batch holds
only plain ``BatchKVCache`` s: ``QuantizedKVCache`` has no ``merge``, so a batch could not
take it. :class:`QuantizedBatchKVCache` is mlx-lm's ``BatchKVCache`` with its keys and
values kept as ``mx.quantize``'s ``(data, scales, biases)`` triples, one per row group of
``group_size`` along the head dimension. It has the attributes mlx-lm's attention looks
for (``bits``, ``group_size``), so ``scaled_dot_product_attention`` in
``mlx_lm/models/base.py`` calls ``quantized_scaled_dot_product_attention`` on it, with the
batch's boolean mask (left padding, from ``BatchKVCache.make_mask``) as it is.

Keys and values are turned by a Hadamard matrix along the head dimension before they are
quantized (:func:`hadamard`), as QuaRot and TurboQuant do: a few large channels no longer
set a whole group's range, which cuts the error by about a third (SmolLM2-135M, 64
prompts, 8 bits: mean |dlogprob| 0.0115 -> 0.0078). Attention over them turns the queries
the same way and the output back, so this module puts its own function in
``mlx_lm.models.base``'s ``quantized_scaled_dot_product_attention`` (the one name every
mlx-lm model's attention reaches a quantized cache through); it passes anything but this
cache's keys to mlx-lm's.

Rows join (``extend``, ``merge``), leave (``filter``), roll back (``trim``,
``prepare(right_padding=...)`` + ``finalize``, as speculative decoding rolls back a plain
batch) and are taken out for the prefix cache (``extract``) as mlx-lm's own single-stream
``QuantizedKVCache``, which its prompt-cache files save and load unchanged (the disk tier).
The padding is kept on the host too, so that a filter or an extract never reads it back
from the device.

With ``kv_quant_start`` (mlx-lm's ``quantized_kv_start``), a batch's caches stay plain
until its longest row holds more than that many tokens, then are quantized in place: short
exchanges keep full precision and the plain cache's faster joins.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx_lm.models.base as mlx_lm_base
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, dynamic_roll

Triple = tuple[mx.array, mx.array, mx.array]
TEXT_KV_BITS = (4, 8)
# the least queries of a chunk that attends over dequantized keys on the CPU (attends_plain)
PLAIN_ATTENTION_QUERIES = 32


@dataclass(frozen=True)
class KVQuant:
    """How a text model's KV cache is quantized: ``bits`` per element in groups of
    ``group_size``, once a batch's longest row holds more than ``start`` tokens."""

    bits: int
    group_size: int = 64
    start: int = 0

    def bytes_per_token(self, kv_heads: int, head_dim: int, layers: int, dtype_bytes: int) -> int:
        """KV bytes one token takes: packed data plus a scale and a bias per group."""
        per_row = head_dim * self.bits // 8 + 2 * (head_dim // self.group_size) * dtype_bytes
        return 2 * kv_heads * per_row * layers


# names the rotation in the disk tier's fingerprint: files quantized otherwise are not read
ROTATION = "hadamard-blocks"


@functools.lru_cache(maxsize=32)
def hadamard(dim: int, dtype: mx.Dtype) -> tuple[mx.array, int] | None:
    """``(H, c)`` with ``H`` symmetric and ``H @ H = c * I`` (``c`` 1 or 2): a Sylvester
    Hadamard matrix on blocks of the largest power of two dividing ``dim``, scaled by a
    power of two so that every entry is exact in any float type; None when that block is
    under 16 wide (too narrow to spread a channel over)."""
    block = dim & -dim
    if block < 16:
        return None
    h = np.ones((1, 1), dtype=np.float32)
    while h.shape[0] < block:
        h = np.block([[h, h], [h, -h]])
    half = (block.bit_length() - 1) // 2
    h = np.kron(np.eye(dim // block, dtype=np.float32), h) / 2.0**half
    return mx.array(h, dtype=dtype), block // 4**half


def rotate(x: mx.array) -> mx.array:
    """``x`` turned along its last axis as the cache stores it (itself when unturned)."""
    turn = hadamard(x.shape[-1], x.dtype)
    return x if turn is None else x @ turn[0]


def quantize(x: mx.array, bits: int, group_size: int) -> Triple:
    data, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
    return data, scales, biases


def quantize_kv(x: mx.array, bits: int, group_size: int) -> Triple:
    """Plain keys or values as the cache holds them: turned (:func:`hadamard`), quantized."""
    return quantize(rotate(x), bits, group_size)


class Fetched(tuple):
    """A layer's quantized keys or values through this step as the cache hands them to
    attention: the triple, and whether this chunk attends over it dequantized
    (:func:`attends_plain`)."""

    plain: bool = False


_MLX_LM_QUANTIZED_ATTENTION = mlx_lm_base.quantized_scaled_dot_product_attention


def quantized_attention(
    queries: mx.array,
    q_keys: Any,
    q_values: Any,
    scale: float,
    mask: Any,
    group_size: int = 64,
    bits: int = 8,
) -> mx.array:
    """mlx-lm's ``quantized_scaled_dot_product_attention`` for this module's cache: the
    queries turned as the keys were, quantized or plain (:class:`Fetched`), the output
    turned back. Anything else goes to mlx-lm's own."""
    if not isinstance(q_keys, Fetched):
        return _MLX_LM_QUANTIZED_ATTENTION(queries, q_keys, q_values, scale, mask, group_size, bits)
    turn = hadamard(queries.shape[-1], queries.dtype)
    if turn is not None:
        queries, scale = queries @ turn[0], scale / turn[1]
    if q_keys.plain:
        keys, values = (
            mx.dequantize(t[0], t[1], t[2], group_size=group_size, bits=bits)
            for t in (q_keys, q_values)
        )
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    else:
        out = _MLX_LM_QUANTIZED_ATTENTION(
            queries, tuple(q_keys), tuple(q_values), scale, mask, group_size, bits
        )
    if turn is None:
        return out
    out = out @ turn[0]
    return out if turn[1] == 1 else out / turn[1]


mlx_lm_base.quantized_scaled_dot_product_attention = quantized_attention


def _rows_of(cache: Any) -> list[int]:
    left = getattr(cache, "left", None)
    if left is not None:
        return list(left)
    return [int(p) for p in cache.left_padding.tolist()]


class QuantizedBatchKVCache(BatchKVCache):
    """mlx-lm's ``BatchKVCache`` over quantized keys and values.

    Invariants as mlx-lm's: rows are right-aligned on ``_idx``; row ``i`` holds positions
    ``[left[i], _idx)``; ``offset[i] == _idx - left[i]``. ``keys``/``values`` are triples
    of ``[rows, heads, length, ...]`` arrays (``None`` before the first update).
    """

    step = 256
    # mlx-lm starts them as None; here they are (data, scales, biases) triples once written
    keys: Any
    values: Any
    _right_padding: Any

    def __init__(self, left_padding: list[int], bits: int = 8, group_size: int = 64) -> None:
        super().__init__(list(left_padding))
        self.bits, self.group_size = bits, group_size
        self._set_left(list(left_padding))

    def _set_left(self, left: list[int]) -> None:
        self.left = left
        self.left_padding = mx.array(left)
        self.offset = mx.array([self._idx - p for p in left])

    # -- what the model calls ------------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Fetched, Fetched]:
        """The quantized keys and values through this step, marked for
        :func:`quantized_attention` (plain for a chunk that :func:`attends_plain`)."""
        n, prev = keys.shape[2], self._idx
        qk = quantize_kv(keys, self.bits, self.group_size)
        qv = quantize_kv(values, self.bits, self.group_size)
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            self.keys = self._room(qk, self.keys, prev + n)
            self.values = self._room(qv, self.values, prev + n)
        self._idx += n
        self.offset = self.offset + n
        for dst, src in zip((*self.keys, *self.values), (*qk, *qv), strict=True):
            dst[..., prev : self._idx, :] = src
        k, v = Fetched(self.keys_and_values()[0]), Fetched(self.keys_and_values()[1])
        k.plain = v.plain = attends_plain(n)
        return k, v

    def _room(self, like: Triple, held: Triple | None, need: int) -> Triple:
        """Arrays of ``need`` positions rounded up to ``step``, shaped as ``like``, with
        what ``held`` holds copied in (mlx-lm's growth, one copy)."""
        length = -(-need // self.step) * self.step
        out = []
        for j, x in enumerate(like):
            a = mx.zeros((x.shape[0], x.shape[1], length, x.shape[3]), dtype=x.dtype)
            if held is not None and self._idx:
                a[..., : self._idx, :] = held[j][..., : self._idx, :]
            out.append(a)
        return out[0], out[1], out[2]

    def keys_and_values(self) -> tuple[Triple, Triple]:
        k, v, i = self.keys, self.values, self._idx
        return (
            (k[0][..., :i, :], k[1][..., :i, :], k[2][..., :i, :]),
            (v[0][..., :i, :], v[1][..., :i, :], v[2][..., :i, :]),
        )

    # -- the batch's reshapes ------------------------------------------------------------

    def prepare(
        self, *, left_padding: Any = None, lengths: Any = None, right_padding: Any = None
    ) -> None:
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("Left padding can only be added to an empty BatchKVCache")
            self._set_left([a + int(b) for a, b in zip(self.left, left_padding, strict=True)])
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = list(right_padding)

    def finalize(self) -> None:
        """Roll each row right by its right padding, which becomes left padding (a
        right-padded prefill, a speculative rollback)."""
        if self._right_padding is None:
            return
        pad = self._right_padding
        self._right_padding = None
        shifts = mx.array(pad)[:, None]
        self.keys = _map(lambda x: dynamic_roll(x, shifts, axis=2), self.keys)
        self.values = _map(lambda x: dynamic_roll(x, shifts, axis=2), self.values)
        self._set_left([p + int(r) for p, r in zip(self.left, pad, strict=True)])

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self._set_left(self.left)
        return n

    def filter(self, batch_indices: list[int]) -> None:
        """Keep the rows listed, in that order, then drop the padding every row has."""
        keep = list(batch_indices)
        if self.keys is not None:
            index = mx.array(keep)
            self.keys = _map(lambda x: x[index], self.keys)
            self.values = _map(lambda x: x[index], self.values)
        left = [self.left[i] for i in keep]
        cut = min(left, default=0)
        if cut:
            if self.keys is not None:
                self.keys = _map(lambda x: x[..., cut:, :], self.keys)
                self.values = _map(lambda x: x[..., cut:, :], self.values)
            self._idx -= cut
            left = [p - cut for p in left]
        self._set_left(left)

    def extend(self, other: Any) -> None:
        """``other``'s rows after these, both right-aligned on the later end index (a plain
        batch cache is quantized first)."""
        other = as_quantized(other, self.bits, self.group_size)
        mine, theirs = _rows_of(self), _rows_of(other)
        if self.keys is None and other.keys is None:
            self._set_left(mine + theirs)
            return
        idx = max(self._idx, other._idx)
        ref = self if self.keys is not None else other
        parts = [c._aligned(idx, len(rows), ref) for c, rows in ((self, mine), (other, theirs))]
        self.keys = _cat([p[0] for p in parts])
        self.values = _cat([p[1] for p in parts])
        left = [p + idx - self._idx for p in mine] + [p + idx - other._idx for p in theirs]
        self._idx = idx
        self._set_left(left)

    def _aligned(
        self, idx: int, rows: int, ref: QuantizedBatchKVCache
    ) -> tuple[list[mx.array], list[mx.array]]:
        """Keys and values over ``[0, idx)``: zeros, then this cache's ``[0, _idx)``."""
        out = []
        for part in ("keys", "values"):
            mine, like = getattr(self, part), getattr(ref, part)
            arrays = []
            for j, x in enumerate(like):
                if mine is None or not self._idx:
                    shape = (rows, x.shape[1], idx, x.shape[3])
                    arrays.append(mx.zeros(shape, dtype=x.dtype))
                    continue
                a = mine[j][..., : self._idx, :]
                shift = idx - self._idx
                arrays.append(mx.pad(a, [(0, 0), (0, 0), (shift, 0), (0, 0)]) if shift else a)
            out.append(arrays)
        return out[0], out[1]

    def extract(self, idx: int) -> QuantizedKVCache:
        """Row ``idx`` as mlx-lm's single-stream quantized cache (own arrays)."""
        cache = new_quantized(self.bits, self.group_size)
        start, end = self.left[idx], self._idx
        cache.keys = _map(lambda x: mx.contiguous(x[idx : idx + 1, :, start:end]), self.keys)
        cache.values = _map(lambda x: mx.contiguous(x[idx : idx + 1, :, start:end]), self.values)
        cache.offset = end - start
        return cache

    @property
    def state(self) -> tuple[Any, ...]:
        if self.keys is None:
            return self.keys, self.values, self.offset, self.left_padding, self._idx
        keys, values = self.keys_and_values()
        return keys, values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        keys, values, _, left_padding, self._idx = v
        self.keys, self.values = keys, values
        self._set_left([int(p) for p in left_padding.tolist()])

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(int(x.nbytes) for x in (*self.keys, *self.values))


def attends_plain(queries: int) -> bool:
    """Whether a chunk of ``queries`` tokens attends over dequantized keys and values.

    On the CPU a prefill chunk's attention through ``mx.quantized_matmul`` made a
    2,048-token prefill of SmolLM2-135M 3.3x slower than over plain keys (54 s against
    16 s, 2 cores); dequantizing a layer's cache for the chunk gives the same values to
    BLAS. MLX 0.32's CUDA backend has no ``quantized_matmul`` for attention's shapes,
    a decode step's included ("No implementation for problem shape: 1x65x64x112"), so
    there every step attends plain: the cache still holds quantized bytes. A decode step
    elsewhere keeps the quantized path, which reads the quantized bytes only; Metal keeps
    it for every chunk."""
    if mx.default_device() == mx.cpu:
        return queries >= PLAIN_ATTENTION_QUERIES
    return mx.cuda.is_available()


def new_quantized(bits: int, group_size: int) -> Any:
    """An empty mlx-lm ``QuantizedKVCache`` (typed loosely: mlx-lm types its arrays None)."""
    return QuantizedKVCache(group_size=group_size, bits=bits)


def _map(fn: Any, t: Triple) -> Triple:
    return fn(t[0]), fn(t[1]), fn(t[2])


def _cat(parts: list[list[mx.array]]) -> Triple:
    a, b, c = (mx.concatenate([p[j] for p in parts]) for j in range(3))
    return a, b, c


def single_quantized(cache: Any, bits: int, group_size: int) -> Any:
    """One sequence's layer cache (a prefix-cache entry, a fresh cache) as a quantized
    one of ``bits``/``group_size``: as it is when it already is, else (re)quantized. A
    quantized one is already turned (every quantized cache here is), a plain one is
    turned as it is quantized."""
    if isinstance(cache, QuantizedKVCache):
        if (cache.bits, cache.group_size) == (bits, group_size) or cache.keys is None:
            out = new_quantized(bits, group_size)
            out.keys, out.values, out.offset = cache.keys, cache.values, cache.offset
            return out
        keys, values = cache.keys_and_values()
        turned = [
            mx.dequantize(*t, group_size=cache.group_size, bits=cache.bits) for t in (keys, values)
        ]
    elif isinstance(cache, KVCache):
        if cache.keys is None:
            return new_quantized(bits, group_size)
        turned = [rotate(x) for x in cache.keys_and_values()]
    else:
        raise TypeError(f"{type(cache).__name__} cannot be quantized")
    out = new_quantized(bits, group_size)
    out.keys = quantize(turned[0], bits, group_size)
    out.values = quantize(turned[1], bits, group_size)
    out.offset = int(turned[0].shape[2])
    return out


def merge_quantized(caches: list[Any], bits: int, group_size: int) -> QuantizedBatchKVCache:
    """Single sequences' layer caches as one batch, right-aligned (mlx-lm's merge)."""
    qs: list[Any] = [single_quantized(c, bits, group_size) for c in caches]
    lengths = [c.offset if c.keys is not None else 0 for c in qs]
    longest = max(lengths, default=0)
    padding = [longest - n for n in lengths]
    batch = QuantizedBatchKVCache(padding, bits, group_size)
    if longest == 0:
        return batch
    ref = next(c for c in qs if c.keys is not None and c.offset)
    parts = []
    for part in ("keys", "values"):
        arrays = []
        for j, x in enumerate(getattr(ref, part)):
            out = mx.zeros((len(qs), x.shape[1], longest, x.shape[3]), dtype=x.dtype)
            for i, (p, c) in enumerate(zip(padding, qs, strict=True)):
                if c.keys is not None and c.offset:
                    out[i : i + 1, :, p:longest] = getattr(c, part)[j][..., : c.offset, :]
            arrays.append(out)
        parts.append((arrays[0], arrays[1], arrays[2]))
    batch.keys, batch.values = parts
    batch._idx = longest
    batch._set_left(padding)
    return batch


def as_quantized(cache: Any, bits: int, group_size: int) -> QuantizedBatchKVCache:
    """A batch layer cache, quantized: as it is when it already is, else its live rows
    (a plain ``BatchKVCache`` or a row pool) quantized into a new one."""
    if isinstance(cache, QuantizedBatchKVCache):
        if (cache.bits, cache.group_size) != (bits, group_size):
            raise ValueError("joining quantized KV caches of different bits or group size")
        return cache
    left = _rows_of(cache)
    out = QuantizedBatchKVCache(left, bits, group_size)
    if cache.keys is None:
        return out
    keys, values = cache.keys_and_values()
    rows = len(left)
    out.keys = quantize_kv(keys[:rows], bits, group_size)
    out.values = quantize_kv(values[:rows], bits, group_size)
    out._idx = cache._idx
    out._set_left(left)
    return out


class QuantizedSeqKVCache(QuantizedKVCache):
    """A sequence's quantized layer cache on its way into the batch: mlx-lm merges a new
    prompt batch through its first sequence's ``merge``, which this one has."""

    def size(self) -> int:
        return int(self.offset)

    def merge(self, caches: list[Any]) -> QuantizedBatchKVCache:
        return merge_quantized(caches, self.bits, self.group_size)


class PlainSeqKVCache(KVCache):
    """A sequence's plain layer cache on its way into a batch that quantizes later
    (``kv_quant_start``): merged plain while every row is short enough, else quantized."""

    def __init__(self, q: KVQuant) -> None:
        super().__init__()
        self.quant = q

    def merge(self, caches: list[Any]) -> Any:  # type: ignore[override]
        q = self.quant
        if (
            any(isinstance(c, QuantizedKVCache) for c in caches)
            or max((kv_size(c) for c in caches), default=0) > q.start
        ):
            return merge_quantized(caches, q.bits, q.group_size)
        return BatchKVCache.merge(caches)


def for_batch(cache: list[Any], q: KVQuant) -> list[Any]:
    """A sequence's caches as the quantized batch takes them: every plain or quantized
    KV layer as a :class:`QuantizedSeqKVCache`, or, under ``q.start``, a plain one as a
    :class:`PlainSeqKVCache` (other layer kinds as they are)."""
    out: list[Any] = []
    for c in cache:
        if not (isinstance(c, KVCache) or isinstance(c, QuantizedKVCache)):
            out.append(c)
        elif isinstance(c, KVCache) and kv_size(c) <= q.start and q.start:
            p = PlainSeqKVCache(q)
            p.keys, p.values, p.offset = c.keys, c.values, c.offset
            out.append(p)
        else:
            s = single_quantized(c, q.bits, q.group_size)
            seq = QuantizedSeqKVCache(group_size=q.group_size, bits=q.bits)
            seq.keys, seq.values, seq.offset = s.keys, s.values, s.offset
            out.append(seq)
    return out


def _plain(c: Any) -> bool:
    return isinstance(c, BatchKVCache) and not isinstance(c, QuantizedBatchKVCache)


def quantized_when_due(caches: list[Any], q: KVQuant | None, force: bool = False) -> list[Any]:
    """A batch's layer caches with the plain ones quantized once its longest row holds
    more than ``q.start`` tokens (or ``force``: a quantized batch joins them); the same
    list when nothing is due."""
    if q is None or not any(_plain(c) for c in caches):
        return caches
    if not force:
        c = next(c for c in caches if _plain(c))
        if c._idx - min(_rows_of(c), default=c._idx) <= q.start:
            return caches
    return [as_quantized(c, q.bits, q.group_size) if _plain(c) else c for c in caches]


def joined_kinds(a: list[Any], b: list[Any], q: KVQuant | None) -> tuple[list[Any], list[Any]]:
    """Two batches' layer caches about to join, both quantized when either is."""
    if q is None or not a or not b:
        return a, b
    if any(isinstance(c, QuantizedBatchKVCache) for c in (*a, *b)):
        return quantized_when_due(a, q, True), quantized_when_due(b, q, True)
    return a, b


def kv_size(cache: Any) -> int:
    """Tokens a single-sequence layer cache holds (mlx-lm's ``QuantizedKVCache`` has no
    ``size()``: its offset is it)."""
    if isinstance(cache, QuantizedKVCache):
        return int(cache.offset)
    return int(cache.size()) if hasattr(cache, "size") else 0
