"""The prefix cache's disk tier: index rebuilt from headers, LRU bound, redundancy, and
files that must never be loaded (another model or version, truncated, corrupt, a write's
leftover temporary file)."""

from __future__ import annotations

import os
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache, load_prompt_cache

from mlxd.engines.options import TextEngineOptions
from mlxd.engines.prefix_disk import DiskPrefixCache, model_fingerprint, read_header


def kv(n: int, layers: int = 2, seed: int = 0) -> list[KVCache]:
    out = []
    for i in range(layers):
        c = KVCache()
        c.keys = (mx.arange(n * 8, dtype=mx.float32).reshape(1, 2, n, 4) + seed + i).astype(
            mx.bfloat16
        )
        c.values = c.keys * 2
        c.offset = n
        out.append(c)
    return out


def tier(path, max_bytes=1 << 24, fp="fp-a", **kw) -> DiskPrefixCache:
    return DiskPrefixCache(path, fp, max_bytes, kw.pop("min_tokens", 32), "m", **kw)


def write(d: DiskPrefixCache, tokens: list[int], cache=None) -> None:
    assert d.spill(tokens, cache or kv(len(tokens)))
    d.flush(10)


def files(d: DiskPrefixCache) -> list[str]:
    return sorted(p.name for p in d.dir.iterdir())


def test_round_trip_and_index_rebuilt_after_a_restart(tmp_path):
    d = tier(tmp_path)
    toks = list(range(100, 180))
    write(d, toks)
    assert len(files(d)) == 1 and d.bytes_written == d.nbytes > 0
    d.close()
    again = tier(tmp_path)  # a restart: the index comes from the file headers
    assert again.stats()["entries"] == 1
    entry, n = again.match(toks[:50] + [1, 2, 3])
    assert n == 50
    tokens, cache, _ = again.load(entry).result(10)
    assert list(tokens) == toks
    assert cache[0].offset == 80 and mx.array_equal(cache[1].values, kv(80)[1].values)
    assert cache[0].keys.dtype == mx.bfloat16
    assert again.match(list(range(20)) + toks)[0] is None  # shares no prefix
    assert again.match(toks[:20] + [0] * 40)[0] is None  # 20 < min_tokens
    # the whole prompt cached: the last prompt token still runs
    assert again.match(toks)[1] == 79
    # mlx-lm reads the file as its own prompt-cache format
    assert load_prompt_cache(str(again.dir / files(again)[0]))[0].offset == 80


def test_rotating_caches_round_trip(tmp_path):
    d = tier(tmp_path)
    rc = []
    for c in kv(40):
        r = RotatingKVCache(max_size=64, keep=0)
        r.update_and_fetch(c.keys, c.values)
        rc.append(r)
    write(d, list(range(40)), rc)
    _, cache, _ = d.load(d.match(list(range(40)) + [7])[0]).result(10)
    assert type(cache[0]) is RotatingKVCache and cache[0].max_size == 64
    assert mx.array_equal(cache[0].keys[..., :40, :], rc[0].keys[..., :40, :])


def test_lru_bound_and_redundant_prefixes(tmp_path):
    d = tier(tmp_path)
    write(d, list(range(40)))
    one = d.nbytes
    write(d, list(range(60)))  # extends the first: the first goes
    assert d.stats()["entries"] == 1
    assert not d.spill(list(range(50)), kv(50))  # a prefix of what is on disk: no write
    # the next turn of a chat re-tokenizes the end of the last answer: an entry that
    # differs from a newer one only in its last few tokens goes too...
    write(d, list(range(200, 260)) + [7, 7, 7])
    write(d, list(range(200, 260)) + [8] * 40)
    assert d.stats()["entries"] == 2 and d.match(list(range(200, 263)) + [1])[1] == 60
    # ...but one that differs in more than a block stays (another conversation)
    write(d, list(range(300, 340)) + [1] * 30)
    write(d, list(range(300, 340)) + [2] * 30)
    assert d.stats()["entries"] == 4
    d.close()

    d = tier(tmp_path / "b", max_bytes=int(3.5 * one))
    seqs = [list(range(s, s + 40)) for s in (1000, 2000, 3000)]
    for s in seqs:
        write(d, s)
        time.sleep(0.01)
    first = d.match(seqs[0] + [5])[0]
    d.load(first).result(10)  # touched: now the most recently used
    write(d, list(range(4000, 4040)))
    assert d.nbytes <= d.max_bytes and d.evictions == 1
    assert d.match(seqs[1] + [5])[0] is None  # the least recently used went
    assert d.match(seqs[0] + [5])[0] is not None
    d.close()
    # the access order survived the restart (mtime): the next eviction takes seqs[2]
    d = tier(tmp_path / "b", max_bytes=int(3.5 * one))
    write(d, list(range(5000, 5040)))
    assert d.match(seqs[2] + [5])[0] is None and d.match(seqs[0] + [5])[0] is not None


def test_files_that_must_not_load_are_removed(tmp_path):
    d = tier(tmp_path)
    names: list[str] = []
    for s in (0, 100, 200, 300, 400):  # names[i]: the file of range(100 i, 100 i + 40)
        write(d, list(range(s, s + 40)))
        names += [n for n in files(d) if n not in names]
    d.close()
    path = [d.dir / n for n in names]
    # another model: a file written under fingerprint b, put in a's folder in place of one
    other = tier(tmp_path, fp="fp-b")
    write(other, list(range(0, 40)))
    os.replace(other.dir / files(other)[0], path[0])
    path[1].write_bytes(path[1].read_bytes()[:-7])  # truncated
    raw = bytearray(path[2].read_bytes())  # another mlxd version (same header length)
    i = raw.index(b'"0.mlxd_version":"') + len(b'"0.mlxd_version":"')
    raw[i] = ord("9")
    path[2].write_bytes(bytes(raw))
    raw = bytearray(path[3].read_bytes())  # flipped bytes in the array data
    raw[-5] ^= 0xFF
    path[3].write_bytes(bytes(raw))
    (d.dir / "junk.safetensors").write_bytes(b"not a safetensors file")

    d = tier(tmp_path)
    # at start: the other model's, the truncated, the other version's and the junk file
    assert d.removed_bad == 4
    assert sorted(files(d)) == sorted([names[3], names[4]])
    # the corrupt data passes the header check and is caught by the checksum on reading
    entry, _ = d.match(list(range(300, 340)) + [1])
    assert d.load(entry).result(10) is None
    assert files(d) == [names[4]] and d.match(list(range(300, 340)) + [1])[0] is None
    assert d.load(d.match(list(range(400, 440)) + [1])[0]).result(10) is not None
    assert read_header(d.dir / names[4])["fingerprint"] == "fp-a"


def test_leftover_temporary_files_are_never_loaded_and_stale_ones_go(tmp_path):
    """A crash between writing and renaming leaves ``<key>-<pid>-<thread>.tmp.safetensors``:
    a complete, valid cache file under a temporary name. It must never be indexed or read
    (a rename that never happened is a write that never finished); one older than an hour
    is a crashed write and is deleted at start, a fresh one may be another process's write
    in flight (two servers on one MLXD_HOME) and is left alone."""
    d = tier(tmp_path)
    toks = list(range(500, 560))
    write(d, toks)
    (done,) = files(d)
    d.close()
    key = done.removesuffix(".safetensors")
    fresh, stale = (d.dir / f"{key}-{pid}-1.tmp.safetensors" for pid in (11, 12))
    os.replace(d.dir / done, fresh)
    stale.write_bytes(fresh.read_bytes())
    hours_ago = time.time() - 2 * 3600
    os.utime(stale, (hours_ago, hours_ago))

    d = tier(tmp_path)
    assert d.stats()["entries"] == 0 and d.nbytes == 0
    assert d.match(toks + [1])[0] is None  # nothing to load: the request prefills
    assert files(d) == [fresh.name]  # the stale one went, the fresh one stays untouched
    assert d.removed_bad == 0  # not counted as invalid cache files: they never were ones
    # the same tokens written again land under the real name, beside the leftover
    write(d, toks)
    assert sorted(files(d)) == sorted([done, fresh.name]) and d.match(toks + [1])[1] == 60
    d.close()


def test_fingerprint_follows_the_files_and_the_options(tmp_path):
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 64)
    fp = model_fingerprint(tmp_path, {"dtype": "bfloat16"})
    assert fp == model_fingerprint(tmp_path, {"dtype": "bfloat16"})
    assert fp != model_fingerprint(tmp_path, {"dtype": "float32"})
    (tmp_path / "model.safetensors").write_bytes(b"\1" * 64)
    assert fp != model_fingerprint(tmp_path, {"dtype": "bfloat16"})


def test_a_newcomer_shares_a_finished_read_not_yet_taken_in(tmp_path, tiny_llama):
    """The race CI once lost: the second of two requests continuing one conversation arrives
    after the disk read of the first finished but before the device thread took it into
    memory. It must wait on that read, not read the same file again."""
    from mlxd.core.types import SamplingParams
    from mlxd.engines.llm import LLMEngine

    def engine() -> LLMEngine:
        e = LLMEngine(
            "m",
            tiny_llama,
            TextEngineOptions(
                prefix_cache_bytes=1 << 26,
                prefix_cache_dir=tmp_path,
                prefix_cache_disk_bytes=1 << 26,
                prefix_cache_disk_min_tokens=32,
                prefix_cache_disk_writes="all",
            ),
        )  # the first, one-off request too
        e.bind()
        return e

    def run(e: LLMEngine, prompts: list[list[int]], settle=None) -> None:
        seqs = [e.new_sequence(p, SamplingParams(max_tokens=2, temperature=0.0)) for p in prompts]
        for s in seqs:
            s.handle = None
            e.add(s)
            s.t_added = 0.0
            if settle:
                settle()
        for _ in range(500):
            if not e.has_work():
                break
            e.step()
        assert all(s.finished for s in seqs)

    first = engine()
    prompt = first.encode_prompt("the quick brown fox jumps over the lazy dog " * 6)
    run(first, [prompt])
    first.close()  # the spilled conversation is on disk

    second = engine()
    try:
        assert second.disk.stats()["entries"] == 1
        on_disk = second.disk.stats()["bytes"]
        # each newcomer is added only once the reads in flight are done
        run(
            second,
            [prompt + [5, 6], prompt + [7, 8]],
            settle=lambda: [f.result(10) for _, f in second._loading],
        )
        st = second.disk.stats()
        assert st["hits"] == 2 and st["bytes_read"] == on_disk
    finally:
        second.close()


def test_a_write_compares_only_entries_near_its_prefix(tmp_path, monkeypatch):
    """The redundancy check of a write runs under the lock the device thread's match()
    takes: it must compare the near-prefixes of the new entry, not every entry sharing
    the chat template's preamble, and still find those near-prefixes."""
    from mlxd.engines import prefix_disk

    d = tier(tmp_path)
    preamble = list(range(7000, 7032))
    for i in range(30):
        write(d, preamble + [9000 + i] * 40)  # more than a block apart: all stay
    near = preamble + list(range(40)) + [3] * 10  # 82 tokens
    write(d, near)
    assert d.stats()["entries"] == 31
    calls = []
    real = prefix_disk.common_prefix
    monkeypatch.setattr(prefix_disk, "common_prefix", lambda a, b: calls.append(1) or real(a, b))
    write(d, preamble + list(range(40)) + [4] * 40)  # differs from `near` in its last 10
    assert d.stats()["entries"] == 31  # `near` went
    assert len(calls) <= 2
    d.close()


def test_salts_partition_the_disk_tier_across_a_restart(tmp_path):
    d = tier(tmp_path)
    toks = list(range(100, 180))
    assert d.spill(toks, kv(80), "salt-a")
    d.flush(10)
    assert d.match(toks + [1], "salt-b")[0] is None and d.match(toks + [1])[0] is None
    # the same tokens under another salt: a file of their own, not "already on disk"
    assert d.spill(toks, kv(80, seed=1), "salt-b")
    d.flush(10)
    assert len(files(d)) == 2
    d.close()
    again = tier(tmp_path)  # the index rebuilt from the headers keeps each file's salt
    assert again.stats()["entries"] == 2 and again.match(toks + [1])[0] is None
    for salt, seed in (("salt-a", 0), ("salt-b", 1)):
        entry, n = again.match(toks + [1], salt)
        assert n == 80 and entry.salt == salt
        assert read_header(again.dir / (entry.key + ".safetensors"))["salt"] == salt
        _, cache, _ = again.load(entry).result(10)
        assert mx.array_equal(cache[0].keys, kv(80, seed=seed)[0].keys)
    # a longer sequence under salt-b makes only salt-b's file redundant
    assert again.spill(toks + list(range(20)), kv(100), "salt-b")
    again.flush(10)
    assert again.stats()["entries"] == 2 and again.match(toks + [1], "salt-a")[1] == 80
    again.close()
