"""The pieces of data parallelism that are pure logic: which devices ``engine.devices``
names, how the GPU count is read from its probe, and which core the router picks (the
served behaviour is in tests/ops/test_data_parallel.py and tests/cli/test_serve.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from mlxd.config import Settings
from mlxd.core.devices import resolve
from mlxd.frontend.routing import PrefixRouter, block_hashes


def test_device_specs():
    assert [d.name for d in resolve(None, lambda: 8)] == ["default"]
    assert [d.name for d in resolve("cpu:3", lambda: 8)] == ["cpu:0", "cpu:1", "cpu:2"]
    assert [d.name for d in resolve("all", lambda: 0)] == ["cpu:0"]
    gpus = resolve("all", lambda: 2)
    assert [(d.name, d.env["CUDA_VISIBLE_DEVICES"]) for d in gpus] == [
        ("gpu:0", "0"),
        ("gpu:1", "1"),
    ]
    # indices count within the CUDA_VISIBLE_DEVICES mlxd itself was given
    pinned = resolve("gpu:1, 0", lambda: 2, visible="4,6")
    assert [(d.name, d.env["CUDA_VISIBLE_DEVICES"]) for d in pinned] == [
        ("gpu:1", "6"),
        ("gpu:0", "4"),
    ]
    with pytest.raises(ValueError, match="no GPU 2"):
        resolve("0,2", lambda: 2)


def _interpreter(path: Path, script: str) -> str:
    """A stand-in for the probe's Python: a shell script that ignores ``-c PROBE``."""
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(0o755)
    return str(path)


def test_gpu_probe_reads_the_last_line_and_falls_back_to_none(tmp_path, caplog):
    from mlxd.enginecore.supervisor import gpu_count

    # warnings (MLX, a BLAS) may come before the count
    assert gpu_count(_interpreter(tmp_path / "two", "echo 'a warning'; echo 2")) == 2
    assert gpu_count(_interpreter(tmp_path / "none", "echo 0")) == 0
    caplog.set_level(logging.WARNING, logger="mlxd.enginecore.supervisor")
    for name, script in [
        ("crash", "echo boom >&2; exit 1"),
        ("silent", "true"),
        ("garbage", "echo gpus"),
        ("negative", "echo -1"),
        ("hang", "exec sleep 5"),
    ]:
        caplog.clear()
        assert gpu_count(_interpreter(tmp_path / name, script), timeout=0.5) == 0, name
        assert "could not count the GPUs" in caplog.text and "assuming none" in caplog.text
    assert gpu_count(str(tmp_path / "missing")) == 0  # no such interpreter


def test_device_setting_is_checked_and_env_overrides(monkeypatch):
    for bad, why in [("0,0", "named twice"), ("cpu:0", "1 to 64"), ("tpu", "expected all")]:
        with pytest.raises(ValueError, match=why):
            Settings(engine={"devices": bad})
    monkeypatch.setenv("MLXD_ENGINE__DEVICES", " 0, 1 ")
    assert Settings().engine.devices == "0,1"


def test_block_hashes_chain_over_whole_blocks():
    a = block_hashes("m", list(range(100)), block=32)
    assert len(a) == 3  # the partial last block is not hashed
    assert block_hashes("m", [*range(64), 7, 7], block=32)[:2] == a[:2]
    assert block_hashes("m", [1, *range(1, 100)], block=32)[1] != a[1]  # covers what precedes
    assert block_hashes("other", list(range(100)), block=32) != a


def test_router_prefers_the_core_with_the_longest_prefix_until_it_is_much_busier():
    r = PrefixRouter(slack=2, min_tokens=32, block=32)
    conv = block_hashes("m", list(range(96)), block=32)
    other = block_hashes("m", list(range(1000, 1096)), block=32)
    first = r.choose([0, 0], conv)
    assert r.choose([0, 0], other) != first  # idle cores take turns
    longer = block_hashes("m", [*range(96), *range(5000, 5064)], block=32)
    assert r.choose([0, 0], longer) == first
    assert r.choose([2, 0] if first == 0 else [0, 2], longer) == first  # within the slack
    busy = [5, 0] if first == 0 else [0, 5]
    assert r.choose(busy, longer) == 1 - first  # much busier: the least busy core
    assert r.choose([0, 0], longer) == 1 - first  # and the prefix now lives there
    assert r.choose([None, 3], conv) == 1  # a core that cannot serve is never chosen
    with pytest.raises(ValueError):
        r.choose([None, None], conv)


def test_router_forgets_the_oldest_prefixes_beyond_its_bound():
    r = PrefixRouter(slack=0, min_tokens=1, block=4, max_entries=8)
    r.remember(block_hashes("m", list(range(40)), block=4), 1)
    assert r.preferred(block_hashes("m", list(range(40)), block=4)) == 1
    assert r.preferred(block_hashes("m", list(range(8)), block=4)) is None  # evicted
    assert r.preferred(block_hashes("m", list(range(12)), block=4)) == 1


def test_routing_hashes_are_per_cache_salt():
    from mlxd.core.blocks import cache_salt

    toks = list(range(100))
    assert block_hashes("m", toks, 32, "s") == block_hashes("m", toks, 32, "s")
    assert block_hashes("m", toks, 32, "s") != block_hashes("m", toks, 32, "t")
    assert block_hashes("m", toks, 32, "s") != block_hashes("m", toks, 32)
    r = PrefixRouter(slack=0, min_tokens=32, block=32)
    r.remember(block_hashes("m", toks, 32, "s"), 1)
    assert r.preferred(block_hashes("m", toks, 32, "s")) == 1
    assert r.preferred(block_hashes("m", toks, 32, "t")) is None
    # an owner's partition is never reachable by picking a cache_salt, nor the shared one
    assert cache_salt(None, None) is None
    assert len({cache_salt("a", None), cache_salt(None, "a"), cache_salt("a", "")}) == 3
    assert cache_salt("ab", "c") != cache_salt("a", "bc")
    assert cache_salt("a", "x") == cache_salt("a", "x")
