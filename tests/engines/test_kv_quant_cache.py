"""engines/kv_quant.py: the quantized batch cache holds, row for row, what mlx-lm's
``BatchKVCache`` holds (quantized) through any sequence of steps, joins, leaves, trims and
rollbacks; a row comes out as mlx-lm's own ``QuantizedKVCache``; mlx-lm's attention takes
it with the batch's padding mask and gives what attention over the plain keys gives, within
the quantization's error; ``kv_quant_start`` quantizes a plain batch once it is due."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache

from mlxd.engines.kv_quant import (
    PLAIN_ATTENTION_QUERIES,
    Fetched,
    KVQuant,
    PlainSeqKVCache,
    QuantizedBatchKVCache,
    QuantizedSeqKVCache,
    as_quantized,
    for_batch,
    hadamard,
    joined_kinds,
    merge_quantized,
    quantized_when_due,
    rotate,
)
from mlxd.engines.kv_rows import join_caches

H, D, G = 2, 64, 64


def _kv(rows: int, n: int, seed: int) -> tuple[mx.array, mx.array]:
    """Keys and values in sixteenths: their turn by the Hadamard matrix is exact in float32,
    so it gives the same bits whatever shape the BLAS multiplies them in."""
    k = mx.round(16 * mx.random.normal((rows, H, n, D), key=mx.random.key(seed))) / 16
    return k, -2 * k


def _group(lengths: list[int], seed: int, bits: int | None) -> BatchKVCache:
    """A prefilled group, left-padded as mlx-lm pads it."""
    longest = max(lengths)
    pad = [longest - n for n in lengths]
    c = BatchKVCache(pad) if bits is None else QuantizedBatchKVCache(pad, bits, G)
    c.update_and_fetch(*_kv(len(lengths), longest, seed))
    return c


def _deq(t, bits: int) -> np.ndarray:
    return np.array(mx.dequantize(*t, group_size=G, bits=bits))


def _rows_q(c: QuantizedBatchKVCache) -> list[np.ndarray]:
    k, v = c.keys_and_values()
    k, v = _deq(k, c.bits), _deq(v, c.bits)
    return [np.concatenate([k[i, :, p:], v[i, :, p:]]) for i, p in enumerate(c.left)]


def _rows_plain(c: BatchKVCache, bits: int) -> list[np.ndarray]:
    """What the quantized cache should hold: each row turned, quantized, dequantized."""
    k, v = c.keys[..., : c._idx, :], c.values[..., : c._idx, :]
    out = []
    for i, p in enumerate(c.left_padding.tolist()):
        pair = []
        for x in (k, v):
            q = mx.quantize(rotate(x[i : i + 1, :, p:]), group_size=G, bits=bits)
            pair.append(np.array(mx.dequantize(*q, group_size=G, bits=bits))[0])
        out.append(np.concatenate(pair))
    return out


def _same(ours: QuantizedBatchKVCache, theirs: BatchKVCache) -> None:
    assert ours.offset.tolist() == theirs.offset.tolist()
    assert ours.left_padding.tolist() == ours.left
    for a, b in zip(_rows_q(ours), _rows_plain(theirs, ours.bits), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("seed", range(4))
def test_steps_joins_leaves_trims_and_rollbacks_match_mlx_lm(bits, seed):
    rnd = random.Random(seed)
    ours, theirs = _group([3, 7], seed, bits), _group([3, 7], seed, None)
    _same(ours, theirs)
    for step in range(40):
        op = rnd.choice(["step", "step", "chunk", "join", "leave", "trim", "rollback"])
        rows = theirs.offset.shape[0]
        if op == "step" or (op == "chunk" and step % 2):
            kv = _kv(rows, 1 if op == "step" else 5, 100 * seed + step)
            ours.update_and_fetch(*kv)
            theirs.update_and_fetch(*kv)
        elif op == "join":
            lengths = [rnd.randint(1, 12) for _ in range(rnd.randint(1, 3))]
            ours.extend(_group(lengths, 1000 + step, bits))
            theirs.extend(_group(lengths, 1000 + step, None))
        elif op == "leave" and rows > 1:
            keep = sorted(rnd.sample(range(rows), rnd.randint(1, rows - 1)))
            ours.filter(keep)
            theirs.filter(keep)
        elif op == "trim" and min(theirs.offset.tolist()) > 2:
            assert ours.trim(2) == theirs.trim(2) == 2
        elif op == "rollback" and min(theirs.offset.tolist()) > 3:
            drop = [rnd.randint(0, 2) for _ in range(rows)]
            for c in (ours, theirs):  # engines/spec_batch.py's rollback
                c.prepare(right_padding=drop)
                c.finalize()
        _same(ours, theirs)
    for i in range(theirs.offset.shape[0]):
        e, ref = ours.extract(i), theirs.extract(i)
        assert type(e) is QuantizedKVCache and e.offset == ref.offset
        assert (e.bits, e.group_size) == (bits, G)
        np.testing.assert_allclose(
            _deq(e.keys, bits)[0],
            _rows_plain(theirs, bits)[i][:H],
            atol=1e-6,
        )


def _attend(q: mx.array, k: mx.array, v: mx.array, mask: mx.array) -> np.ndarray:
    return np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask))


@pytest.mark.parametrize("dim", [64, 128, 96])
def test_the_turn_is_its_own_inverse_up_to_a_power_of_two(dim):
    h, c = hadamard(dim, mx.float32)
    assert c in (1, 2)
    np.testing.assert_array_equal(np.array(h @ h), c * np.eye(dim))
    assert hadamard(40, mx.float32) is None  # blocks of 8: left plain
    x = mx.ones((1, 1, 2, 40))
    assert rotate(x) is x


@pytest.mark.parametrize("bits", [4, 8])
def test_attention_over_the_batch_is_attention_over_the_plain_keys(bits):
    """mlx-lm's attention, as every model calls it, over the quantized batch: a
    left-padded row attends as it does alone, and both as over the unquantized keys."""
    rows = [_one(4, 1), _one(9, 2)]
    c = merge_quantized(rows, bits, G)
    alone = merge_quantized([_one(4, 1)], bits, G)
    plain = BatchKVCache.merge(rows)
    q = mx.random.normal((1, 4, 1, D), key=mx.random.key(3))
    batch_mask, alone_mask = c.make_mask(1), alone.make_mask(1)
    k1 = _kv(2, 1, 4)
    both = scaled_dot_product_attention(
        mx.concatenate([q, q]), *c.update_and_fetch(*k1), cache=c, scale=0.125, mask=batch_mask
    )
    one = scaled_dot_product_attention(
        q,
        *alone.update_and_fetch(k1[0][:1], k1[1][:1]),
        cache=alone,
        scale=0.125,
        mask=alone_mask,
    )
    np.testing.assert_allclose(np.array(both[0]), np.array(one[0]), atol=1e-5)
    plain_mask = plain.make_mask(1)
    exact = _attend(mx.concatenate([q, q]), *plain.update_and_fetch(*k1), plain_mask)
    np.testing.assert_allclose(np.array(both), exact, atol=0.06 if bits == 8 else 0.6)


@pytest.mark.parametrize(("dim", "group"), [(128, 64), (96, 32)])
def test_heads_of_other_widths_turn_and_attend_as_over_plain_keys(dim, group):
    """128 (H @ H = 2 I) and 96 (blocks of 32) wide heads: the output
    is attention over the plain keys, within 8-bit error, on the quantized path and the
    plain one alike."""
    k = mx.random.normal((1, H, 40, dim), key=mx.random.key(7))
    v = mx.random.normal((1, H, 40, dim), key=mx.random.key(8))
    q = mx.random.normal((1, 4, 1, dim), key=mx.random.key(9))
    c = QuantizedBatchKVCache([0], 8, group)
    fk, fv = c.update_and_fetch(k, v)
    exact = _attend(q, k, v, None)
    for plain in (False, True):
        fk.plain = fv.plain = plain
        out = scaled_dot_product_attention(q, fk, fv, cache=c, scale=0.125, mask=None)
        np.testing.assert_allclose(np.array(out), exact, atol=0.03)


def test_a_prefill_chunk_attends_over_dequantized_keys_as_the_quantized_path_does():
    """A chunk of many queries is marked plain (BLAS attention on the CPU) and attends over
    the same quantized values; the next one-token step is quantized again."""
    n = PLAIN_ATTENTION_QUERIES + 8
    prefix = merge_quantized([_one(5, 1), _one(11, 2)], 8, G)
    keys, values = _kv(2, n, 4)
    q = mx.random.normal((2, 4, n, D), key=mx.random.key(5))
    mask = prefix.make_mask(n)
    k, v = prefix.update_and_fetch(keys, values)
    assert isinstance(k, Fetched) and prefix.bits == 8
    if mx.default_device() == mx.cpu:
        assert k.plain and v.plain
    plain = scaled_dot_product_attention(q, k, v, cache=prefix, scale=0.125, mask=mask)
    qk, qv = Fetched(k), Fetched(v)  # the same triples, read through quantized_matmul
    quant = scaled_dot_product_attention(q, qk, qv, cache=prefix, scale=0.125, mask=mask)
    np.testing.assert_allclose(np.array(plain), np.array(quant), atol=1e-4)
    k1, _ = prefix.update_and_fetch(*_kv(2, 1, 6))
    assert isinstance(k1, Fetched) and k1.plain == bool(mx.cuda.is_available())


def _one(n: int, seed: int) -> KVCache:
    c = KVCache()
    c.update_and_fetch(*_kv(1, n, seed))
    return c


def test_sequences_enter_quantized_and_prefix_entries_convert():
    q = KVQuant(8, G)
    fresh, plain_entry = KVCache(), _one(6, 1)
    four = QuantizedKVCache(G, 4)
    four.update_and_fetch(*_kv(1, 5, 2))
    seqs = [for_batch([c], q)[0] for c in (fresh, plain_entry, four)]
    assert all(type(s) is QuantizedSeqKVCache and s.bits == 8 for s in seqs)
    assert [s.size() for s in seqs] == [0, 6, 5]
    batch = seqs[0].merge(seqs)
    assert isinstance(batch, QuantizedBatchKVCache) and batch.left == [6, 0, 1]


def test_kv_quant_start_keeps_short_batches_plain_and_quantizes_when_due():
    q = KVQuant(4, G, start=8)
    seqs = [for_batch([c], q)[0] for c in (KVCache(), _one(5, 1))]
    assert all(type(s) is PlainSeqKVCache for s in seqs)
    plain = seqs[0].merge(seqs)
    assert type(plain) is BatchKVCache  # every row short: mlx-lm's own batch
    assert quantized_when_due([plain], q)[0] is plain
    plain.update_and_fetch(*_kv(2, 4, 2))  # the longest row now holds 9 tokens
    (quant,) = quantized_when_due([plain], q)
    assert isinstance(quant, QuantizedBatchKVCache) and quant.bits == 4
    _same(quant, plain)
    long_entry = for_batch([_one(12, 3)], q)[0]
    assert type(long_entry) is QuantizedSeqKVCache  # a long prefix enters quantized
    assert isinstance(seqs[0].merge([seqs[0], long_entry]), QuantizedBatchKVCache)


def test_a_row_pool_joins_a_quantized_batch_through_quantization():
    q = KVQuant(8, G, start=100)
    pool = join_caches(_group([2, 5], 1, None), _group([4], 2, None))
    ref = join_caches(_group([2, 5], 1, None), _group([4], 2, None))
    quant = _group([3], 3, 8)
    a, b = joined_kinds([pool], [quant], q)
    assert isinstance(a[0], QuantizedBatchKVCache) and b[0] is quant
    _same(as_quantized(ref, 8, G), BatchKVCache.merge([ref.extract(i) for i in range(3)]))
    a[0].extend(b[0])
    assert a[0].offset.tolist() == [2, 5, 4, 3]
