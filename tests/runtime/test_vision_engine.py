"""The vision engine without a server: feature-cache modes, batch vs one-at-a-time, the LRU."""

from __future__ import annotations

import hashlib
import io

import pytest
from conftest import require  # noqa: E402

require("mlx_vlm")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from fixtures.tiny_vlm import make_tiny_qwen2_vl  # noqa: E402
from PIL import Image  # noqa: E402

from mlxd.core.types import SamplingParams  # noqa: E402
from mlxd.engines.options import VisionEngineOptions  # noqa: E402
from mlxd.engines.vlm import LoadedImage, VisionEngine  # noqa: E402
from mlxd.engines.vlm_features import FeatureCache  # noqa: E402


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory):
    return make_tiny_qwen2_vl(tmp_path_factory.mktemp("vlm") / "tiny-qwen2-vl")


def _image(seed: int, size=(60, 44)) -> LoadedImage:
    arr = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    data = buf.getvalue()
    return LoadedImage(
        Image.open(io.BytesIO(data)).convert("RGB"), hashlib.sha256(data).hexdigest()
    )


def _msgs(n: int) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                *({"type": "image"} for _ in range(n)),
                {"type": "text", "text": "Describe."},
            ],
        }
    ]


def _run(engine: VisionEngine, prompts: list, max_tokens: int = 10) -> list[list[int]]:
    """Each prompt's generated token ids (the engine emits ids; front ends detokenize)."""
    seqs = [
        engine.new_sequence(p, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        for p in prompts
    ]
    for s in seqs:
        engine.add(s)
    tokens: dict[int, list[int]] = {id(s): [] for s in seqs}
    while engine.has_work():
        for seq, ev in engine.step():
            assert ev.error is None, ev.error
            if ev.token is not None:
                tokens[id(seq)].append(ev.token)
    return [tokens[id(s)] for s in seqs]


def test_feature_cache_is_lru_by_entries_and_bytes():
    c = FeatureCache(max_entries=2, max_bytes=3 * 400)
    a, b, d = (mx.zeros((10, 10)) for _ in range(3))  # 400 bytes each
    c.put("a", a)
    c.put("b", b)
    assert c.get("a") is a  # a is now the most recent
    c.put("d", d)  # over two entries: b (least recent) goes
    assert "b" not in c and "a" in c and "d" in c and c.nbytes == 800
    c.put("big", mx.zeros((40, 40)))  # larger than the whole cache: not kept
    assert "big" not in c and len(c) == 2
    c2 = FeatureCache(max_entries=10, max_bytes=1000)
    for k in "xyz":
        c2.put(k, mx.zeros((10, 10)))
    assert list(c2._items) == ["y", "z"] and c2.nbytes == 800  # bytes bound too
    assert not FeatureCache(0, 100).enabled


def test_cache_modes_agree_and_count_encoder_runs(vlm_path):
    engine = VisionEngine("tiny", vlm_path, VisionEngineOptions(max_num_seqs=8))
    i1, i2 = _image(1), _image(2, (90, 40))
    prompts = [
        engine.encode_vision(messages=_msgs(2), images=[i1, i2]),
        engine.encode_vision(messages=_msgs(1), images=[i2]),
    ]
    want = _run(engine, prompts)
    assert engine.features.mode == "per_image"
    assert (engine.cache_hits, engine.cache_misses, engine.features.encoder_runs) == (1, 2, 2)

    # a family that encodes a request's images together (encode_images, as mlx-vlm's own
    # generate caches it): one entry per ordered set of images
    model = engine.model
    model.encode_images = lambda pv, **kw: model.vision_tower(
        pv.astype(mx.float32), kw["image_grid_thw"], output_hidden_states=False
    )
    engine.features.mode = "per_request"
    engine.features.cache.clear()
    runs = engine.features.encoder_runs
    again = [engine.encode_vision(messages=_msgs(2), images=[i1, i2]) for _ in range(2)]
    assert _run(engine, again[:1]) == want[:1]
    assert _run(engine, again[1:]) == want[:1]
    assert engine.features.encoder_runs == runs + 2  # two images, encoded once

    # a family without a known feature path: the model encodes inside get_input_embeddings
    engine.features.mode = None
    misses = engine.cache_misses
    assert _run(engine, [engine.encode_vision(messages=_msgs(1), images=[i2])]) == want[1:]
    assert engine.cache_misses == misses + 1


def test_one_at_a_time_matches_the_batch(vlm_path):
    batched = VisionEngine("tiny", vlm_path, VisionEngineOptions(max_num_seqs=8))
    single = VisionEngine("tiny", vlm_path, VisionEngineOptions(batching=False))
    imgs = [_image(10 + i) for i in range(3)]

    def prompts(e):
        return [e.encode_vision(messages=_msgs(1), images=[im]) for im in imgs] + [
            e.encode_vision(messages=[{"role": "user", "content": "Hello"}])
        ]

    a = _run(batched, prompts(batched))
    b = _run(single, prompts(single))
    assert a == b and batched.max_batch_seen >= 2 and single.max_batch_seen == 1
    stats = single.feature_cache_stats()
    assert stats["batching"] is False and stats["misses"] == 3


def test_cancel_leaves_no_work(vlm_path):
    for batching in (True, False):
        engine = VisionEngine("tiny", vlm_path, VisionEngineOptions(batching=batching))
        p = [engine.encode_vision(messages=_msgs(1), images=[_image(i)]) for i in range(3)]
        seqs = [engine.new_sequence(x, SamplingParams(max_tokens=50)) for x in p]
        for s in seqs:
            engine.add(s)
        engine.step()
        engine.step()
        for s in seqs:
            engine.cancel(s)
        assert not engine.has_work() and engine.num_running == engine.num_waiting == 0
        assert _run(engine, p[:1], max_tokens=3)  # and it still serves
