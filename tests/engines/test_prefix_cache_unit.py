"""PrefixCache: longest-prefix lookup, trimming, redundancy, byte bound."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlxd.engines.prefix_cache import PrefixCache


def kv(n: int, layers: int = 2) -> list[KVCache]:
    out = []
    for _ in range(layers):
        c = KVCache()
        c.keys = mx.arange(n * 4, dtype=mx.float32).reshape(1, 1, n, 4)
        c.values = c.keys + 1
        c.offset = n
        out.append(c)
    return out


def test_longest_prefix_is_served_and_cut_back():
    pc = PrefixCache(1 << 20)
    pc.insert(list(range(10)), kv(10))
    pc.insert([1, 2, 3, 4], kv(4))
    cache, n = pc.lookup([0, 1, 2, 3, 4, 5, 99, 98])
    assert n == 6
    assert cache[0].offset == 6 and cache[0].keys.shape[2] == 6
    assert mx.array_equal(cache[0].keys, kv(10)[0].keys[..., :6, :])
    # the whole prompt cached: the last token still runs
    cache, n = pc.lookup(list(range(10)))
    assert n == 9
    assert pc.lookup([7, 7, 7]) == (None, 0)
    assert pc.hits == 2 and pc.misses == 1 and pc.tokens_saved == 15


def test_a_view_never_changes_the_entry():
    pc = PrefixCache(1 << 20)
    pc.insert(list(range(8)), kv(8))
    cache, n = pc.lookup(list(range(5)) + [50])
    cache[0].update_and_fetch(mx.zeros((1, 1, 1, 4)), mx.zeros((1, 1, 1, 4)))
    again, _ = pc.lookup(list(range(8)) + [1])
    assert mx.array_equal(again[0].keys, kv(8)[0].keys)


def test_prefixes_are_redundant_and_bytes_are_bounded():
    one = sum(c.nbytes for c in kv(10))
    pc = PrefixCache(3 * one)
    pc.insert(list(range(5)), kv(5))
    pc.insert(list(range(10)), kv(10))  # extends the first: it goes
    assert len(pc) == 1
    for start in (100, 200):
        pc.insert(list(range(start, start + 10)), kv(10))
    # full: a sequence that has shown reuse evicts the least recently used
    assert pc.insert(list(range(300, 310)), kv(10), reused=True)
    assert pc.nbytes <= 3 * one and len(pc) == 3
    assert pc.lookup(list(range(10)))[1] == 0  # least recently used went first
    assert PrefixCache(0).enabled is False


def _seq(tag: int, n: int = 40) -> list[int]:
    return [tag * 1000 + i for i in range(n)]


def test_a_full_tier_admits_only_sequences_that_show_reuse():
    """One-off sequences never evict what is reused; a conversation's first turn is turned
    away, its second gets in (it shares the first's opening blocks), its third hits."""
    one = sum(c.nbytes for c in kv(40))
    limit = 3 * one + one // 10  # three 40-token entries, or two and a 44-token one
    pc = PrefixCache(limit, min_hit_tokens=20)  # admission: the first 2 blocks (32 tokens)
    for tag in (1, 2, 3):
        assert pc.insert(_seq(tag), kv(40))
    assert pc.lookup(_seq(1)[:35] + [7])[1] == 35  # entry 1 used: 2 is now the oldest
    for tag in range(10, 20):  # a flood of one-off prompts: turned away, nothing evicted
        assert not pc.insert(_seq(tag), kv(40))
    assert pc.skipped == 10 and len(pc) == 3 and pc.nbytes == 3 * one
    # shorter than the admission prefix: nothing to recognise it by
    assert not pc.insert(_seq(70, 30), kv(30))
    assert pc.lookup(_seq(2)[:35] + [7])[1] == 35
    # a conversation starting now: turn 1 turned away, turn 2 admitted, turn 3 hits
    turn1 = _seq(50)
    assert not pc.insert(turn1, kv(40))
    turn2 = [*turn1, 1, 2, 3, 4]
    assert pc.lookup(turn2)[1] == 0
    assert pc.insert(turn2, kv(44))
    assert pc.lookup([*turn2, 9])[1] == 44
    assert len(pc) == 3 and pc.nbytes <= limit  # the least recently used (3) went
    assert pc.lookup(_seq(3)[:35] + [7])[1] == 0
    # ... and is remembered: its conversation's next turn gets back in
    assert pc.insert([*_seq(3), 5, 6], kv(42))
    # a request that started from a cached prefix (or a disk read) is always taken
    assert pc.insert(_seq(60), kv(40), reused=True)
    pc.clear()
    assert pc.insert(_seq(80), kv(40)) and len(pc) == 1  # room again: all taken


def test_short_hits_are_ignored_and_the_block_index_finds_long_ones():
    pc = PrefixCache(1 << 22, min_hit_tokens=32)
    pc.insert(list(range(20)), kv(20))
    assert pc.lookup(list(range(20)) + [7]) == (None, 0)  # 20 < 32 tokens: not worth it
    for start in range(1000, 1600, 100):  # many entries, none related
        pc.insert(list(range(start, start + 50)), kv(50))
    long = list(range(200, 300))
    pc.insert(long, kv(100))
    cache, n = pc.lookup(long[:70] + [5, 6])
    assert n == 70 and cache[0].offset == 70
    cache, n = pc.lookup(long[:40] + [9])  # through the index, then the exact prefix
    assert n == 40
    assert pc.lookup(list(range(200, 225)) + [1])[1] == 0  # a 25-token match: too short


def test_an_insert_compares_only_entries_that_may_be_its_prefix(monkeypatch):
    """Every chat prompt shares its template's preamble: an insert must not compare itself
    with every entry that shares it (a cost per insert that grew with the cache), and must
    still find the entries it makes redundant, ending on a block boundary or inside one."""
    from mlxd.engines import prefix_cache

    preamble = list(range(5000, 5032))  # two full blocks every entry shares
    pc = PrefixCache(1 << 26)
    for i in range(200):
        pc.insert(preamble + [10_000 + i] * 20, kv(52))
    inside = preamble + [1, 2, 3, 4, 5]  # ends inside its third block
    boundary = preamble + list(range(16))  # ends on its third block's boundary
    pc.insert(inside, kv(len(inside)))
    pc.insert(boundary, kv(len(boundary)))  # does not extend `inside`: both stay
    assert len(pc) == 202
    calls = []
    real = prefix_cache.common_prefix
    monkeypatch.setattr(prefix_cache, "common_prefix", lambda a, b: calls.append(1) or real(a, b))
    longer = boundary + [1, 2, 3]
    pc.insert(longer, kv(len(longer)))
    assert len(calls) <= 2  # `boundary` (and nothing of the 200 that share the preamble)
    assert len(pc) == 202  # `boundary` went, `longer` came
    assert pc.lookup(boundary + [9])[1] == len(boundary)  # served by `longer`, cut back
    calls.clear()
    again = inside + [6, 7]
    pc.insert(again, kv(len(again)))  # `inside` ends inside the preamble's next block
    assert len(pc) == 202 and len(calls) <= 2


def test_salts_partition_the_cache():
    """Equal tokens under another cache salt neither hit, nor count as redundant, nor
    evict; a short entry (under one block, outside the hash index) is partitioned too."""
    pc = PrefixCache(1 << 20)
    long, short = list(range(40)), [5, 6, 7]
    pc.insert(long, kv(40), salt="a")
    pc.insert(short, kv(3), salt="a")
    assert pc.lookup(long + [1], "b") == (None, 0)
    assert pc.lookup(long + [1]) == (None, 0)  # unsalted is a partition of its own
    assert pc.lookup(short + [1], "b") == (None, 0)
    assert pc.peek(long + [1], "b") == 0 and pc.peek(long + [1], "a") == 40
    assert pc.lookup(long + [1], "a")[1] == 40 and pc.lookup(short + [1], "a")[1] == 3
    pc.insert(long + [9] * 20, kv(60), salt="b")  # extends a's entry, under another salt
    assert len(pc) == 3 and pc.lookup(long + [1], "a")[1] == 40
    assert pc.lookup(long + [9] * 20 + [1], "b")[1] == 60
