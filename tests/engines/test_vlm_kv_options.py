"""The vision engine's KV options reach mlx-vlm's batch (engines/vlm.py): the cache classes
the batch builds for each scheme, and the bytes they hold, read by ``memory_bytes`` (what
the memory budget counts)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import require  # noqa: E402

require("mlx_vlm")  # the [vision] extra

from fixtures.tiny_vlm import make_tiny_qwen2_vl  # noqa: E402

from mlxd.core.types import SamplingParams  # noqa: E402
from mlxd.engines.options import VisionEngineOptions  # noqa: E402
from mlxd.engines.vlm import VisionEngine  # noqa: E402


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> Path:
    return make_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm") / "tiny-qwen2-vl")


def _mid_generation(engine: VisionEngine, n: int = 3) -> tuple[set[str], int]:
    """Run ``n`` text requests until every one has decoded a few tokens; the batch's cache
    classes and KV bytes at that point, then the requests run out."""
    seqs = []
    for i in range(n):
        prompt = engine.encode_vision(messages=[{"role": "user", "content": f"Hello {i} " * 40}])
        seq = engine.new_sequence(prompt, SamplingParams(max_tokens=16, temperature=0.0))
        seq.handle = None
        engine.add(seq)
        seqs.append(seq)
    classes: set[str] = set()
    kv = 0
    for _ in range(200):
        if not engine.has_work():
            break
        engine.step()
        if not classes and all(s.generated >= 4 for s in seqs):
            classes = {type(c).__name__ for c in engine._gen._generation_batch.prompt_cache}
            kv = engine.memory_bytes()["kv_cache"]
    assert not engine.has_work() and all(s.finished for s in seqs)
    return classes, kv


def test_each_scheme_builds_its_cache_and_shrinks_the_kv(vlm_dir):
    seen: dict[str, tuple[set[str], int]] = {}
    for label, opts in {
        "full": {},
        "uniform-8": {"kv_bits": 8, "kv_group_size": 32},
        "turboquant-3.5": {"kv_bits": 3.5},
        "turboquant-4": {"kv_bits": 4, "kv_quant_scheme": "turboquant"},
    }.items():
        engine = VisionEngine("v", vlm_dir, VisionEngineOptions(**opts))
        try:
            assert engine.batching
            seen[label] = _mid_generation(engine)
        finally:
            engine.close()
    assert "BatchKVCache" in seen["full"][0]
    assert "BatchQuantizedKVCache" in seen["uniform-8"][0]
    assert "BatchTurboQuantKVCache" in seen["turboquant-3.5"][0]
    assert "BatchTurboQuantKVCache" in seen["turboquant-4"][0]
    full = seen["full"][1]
    quantized = [seen[k][1] for k in ("uniform-8", "turboquant-3.5", "turboquant-4")]
    assert full > 0 and all(0 < q < full for q in quantized), seen
