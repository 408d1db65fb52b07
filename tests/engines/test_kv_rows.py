"""engines/kv_rows.py: a decode batch's cache with spare rows holds, row for row, what
mlx-lm's ``BatchKVCache`` holds through any sequence of steps, joins and leaves; joins that
fit copy no running row, and memory stays within the batch's high-water mark."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.utils import load

from mlxd.engines.kv_rows import RowPoolKVCache
from mlxd.engines.serving_batch import ServingBatchGenerator, fill_order, join_into

H, D = 2, 4


def _group(lengths: list[int], tag: float) -> BatchKVCache:
    """A prefilled group as mlx-lm makes it: left-padded prompts of these lengths, each
    position's keys unique (so a misplaced row or position shows)."""
    longest = max(lengths)
    c = BatchKVCache([longest - n for n in lengths])
    if longest:
        k = (
            mx.arange(len(lengths) * H * longest * D, dtype=mx.float32).reshape(
                len(lengths), H, longest, D
            )
            + tag
        )
        c.update_and_fetch(k, -k)
    return c


def _rows(c: BatchKVCache, n: int) -> list[np.ndarray]:
    """Each live row's positions from its start to the end index, keys and values."""
    lp = c.left_padding.tolist()
    k, v = (
        c.keys_and_values()
        if isinstance(c, RowPoolKVCache)
        else (c.keys[..., : c._idx, :], c.values[..., : c._idx, :])
    )
    return [
        np.concatenate([np.array(k[i, :, lp[i] :]), np.array(v[i, :, lp[i] :])]) for i in range(n)
    ]


def _same(ours: BatchKVCache, theirs: BatchKVCache) -> None:
    n = theirs.offset.shape[0]
    assert ours.offset.shape[0] == n
    # each row's length (its RoPE position) and contents; where rows start in the arrays
    # may differ (the pool drops padding every row has less eagerly)
    assert ours.offset.tolist() == theirs.offset.tolist()
    assert (ours._idx - np.array(ours.left_padding)).tolist() == theirs.offset.tolist()
    for a, b in zip(_rows(ours, n), _rows(theirs, n), strict=True):
        np.testing.assert_array_equal(a, b)
    for i in range(n):  # what a finished row hands the prefix cache
        a, b = ours.extract(i), theirs.extract(i)
        np.testing.assert_array_equal(np.array(a.keys), np.array(b.keys))
        assert a.offset == b.offset


def _step(c: BatchKVCache, n: int, tag: float) -> None:
    k = mx.full((n, H, 1, D), tag, dtype=mx.float32)
    c.update_and_fetch(k, -k)


def _copy(c: BatchKVCache) -> BatchKVCache:
    out = BatchKVCache(c.left_padding.tolist())
    out.keys, out.values = mx.array(c.keys), mx.array(c.values)
    out.offset, out._idx = mx.array(c.offset), c._idx
    return out


@pytest.mark.parametrize("seed", range(8))
def test_the_pool_holds_what_mlx_lm_holds_through_joins_leaves_and_steps(seed):
    """Random steps, joins (groups shorter and longer than the batch) and leaves, applied
    to mlx-lm's cache and to ours as the decode batch applies them (``join_into``, the
    batch's fill order for leaves): the same rows, positions, padding and offsets."""
    rng = random.Random(seed)
    theirs = _group([rng.randint(1, 9) for _ in range(3)], 0.0)
    ours: BatchKVCache = _copy(theirs)  # plain until its first join, as in the batch
    tag, joins_in_place = 0.0, 0
    for _ in range(60):
        n = theirs.offset.shape[0]
        op = rng.random()
        if op < 0.3:
            lengths = [
                rng.randint(1, 12) if rng.random() < 0.85 else rng.randint(200, 300)
                for _ in range(rng.randint(1, 4))
            ]
            tag += 1000.0
            capacity = ours.capacity if isinstance(ours, RowPoolKVCache) else -1
            before = ours
            ours = join_into(ours, _group(lengths, tag))
            theirs.extend(_group(lengths, tag))
            if ours is before and ours.capacity == capacity:
                joins_in_place += 1
        elif op < 0.55 and n > 1:
            keep = sorted(rng.sample(range(n), rng.randint(1, n - 1)))
            order = fill_order(keep) if isinstance(ours, RowPoolKVCache) else keep
            ours.filter(order)
            theirs.filter(order)
        else:
            tag += 1.0
            _step(ours, n, tag)
            _step(theirs, n, tag)
        _same(ours, theirs)
    assert isinstance(ours, RowPoolKVCache)
    assert joins_in_place > 0


def test_fill_order_moves_only_the_rows_above_the_kept_count():
    assert fill_order([0, 1, 2]) == [0, 1, 2]
    assert fill_order([0, 2, 3, 5]) == [0, 5, 2, 3]
    assert fill_order([4, 5]) == [4, 5]
    assert sorted(fill_order([1, 3, 6, 7, 8])) == [1, 3, 6, 7, 8]


def test_a_stale_inf_in_a_spare_row_never_reaches_a_newcomer():
    """A spare row keeps what its last occupant left; a group written there gets zeros
    over its padding, since a masked position weighs 0 and 0 times inf is NaN."""
    pool = join_into(_group([4, 4], 0.0), _group([4], 10.0))
    _step(pool, 3, 1.0)
    pool.keys = pool.keys.at[2].add(mx.inf)  # the third row's keys went bad, and it leaves
    pool.filter(fill_order([0, 1]))
    assert pool.join(_group([2], 20.0))
    keys, _ = pool.keys_and_values()
    assert np.isfinite(np.array(keys[2])).all()


def test_memory_stays_within_the_high_water_mark_and_is_given_back():
    pool = join_into(_group([5] * 6, 0.0), _group([5] * 2, 1.0))
    assert pool.capacity == 8
    pool.filter(fill_order([0, 1, 2, 3, 4]))
    assert pool.join(_group([3, 3, 3], 2.0)) and pool.capacity == 8  # fits: no new rows
    assert not pool.join(_group([3], 3.0))  # full: the batch rebuilds, to 9 rows
    pool.extend(_group([3], 3.0))
    assert pool.capacity == 9 and pool.rows == 9
    pool.filter(fill_order([0, 1, 2, 3]))  # 4 of 9 live: kept (a quarter would shrink)
    assert pool.capacity == 9
    for _ in range(pool.keys.shape[2] - pool._idx + 1):  # past the end: grows, halves
        _step(pool, 4, 5.0)
    assert pool.capacity == 4
    pool.extend(_group([2] * 5, 6.0))  # 9 again: rebuilt to 9 rows
    assert pool.capacity == 9
    pool.filter(fill_order([3, 7]))  # 2 of 9, under a quarter: shrinks to the rows kept
    assert pool.capacity == 2 and pool.rows == 2
    assert pool.nbytes == pool.keys.nbytes + pool.values.nbytes


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_llama):
    return load(str(tiny_llama))


def test_a_batch_joined_and_left_all_the_time_decodes_what_mlx_lm_decodes(model_and_tokenizer):
    """Requests of different lengths arrive every few steps and finish at different
    steps, so the decode batch is joined and left over and over: the same greedy tokens
    as mlx-lm's own batch, and the joins after the first land in spare rows."""
    model, tok = model_and_tokenizer
    words = "the river runs to the sea a city of music and light winter morning".split()
    rng = random.Random(7)
    plan = [
        (step, tok.encode(" ".join(rng.sample(words, rng.randint(1, 9)))), rng.randint(3, 14))
        for step in range(0, 40, 3)
    ]
    kw = dict(prefill_step_size=16, completion_batch_size=16, prefill_batch_size=4)
    results = []
    for cls in (ServingBatchGenerator, BatchGenerator):
        gen = cls(model, **kw)
        out: dict[int, list[int]] = {}
        pooled = 0
        for step in range(200):
            for at, prompt, n in plan:
                if at == step:
                    out[gen.insert([prompt], max_tokens=[n])[0]] = []
            _, responses = gen.next()
            for r in responses:
                out[r.uid].append(r.token)
            caches = gen._generation_batch.prompt_cache
            pooled += bool(caches) and isinstance(caches[0], RowPoolKVCache)
            if step > 40 and all(
                len(v) == n for v, (_, _, n) in zip(out.values(), plan, strict=True)
            ):
                break
        results.append((list(out.values()), pooled))
    (ours, pooled), (theirs, _) = results
    assert ours == theirs
    assert [len(v) for v in ours] == [n for _, _, n in plan]
    assert pooled > 20  # most steps ran over the pool
