"""Which vision families get the image-feature cache, and how (engines/vlm_features.py),
decided on mlx-vlm's real model classes (uninitialised: the choice reads only the class,
its module and ``config.model_type``)."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
from conftest import require  # noqa: E402

require("mlx_vlm")  # the [vision] extra

from mlxd.engines.vlm_features import FeatureCache, FeatureEncoder  # noqa: E402


def _mode(family: str) -> str | None:
    cls = importlib.import_module(f"mlx_vlm.models.{family}").Model
    model = cls.__new__(cls)  # no weights: only the class and its module matter
    dict.__init__(model)
    model["config"] = SimpleNamespace(model_type=family)
    if family in ("qwen2_vl", "qwen2_5_vl"):
        model["vision_tower"] = object()
    return FeatureEncoder(model, FeatureCache(4, 1 << 20)).mode


@pytest.mark.parametrize(
    "family, mode",
    [
        ("qwen2_vl", "per_image"),
        ("qwen2_5_vl", "per_image"),
        ("gemma4", "per_request"),
        ("lfm2_vl", "per_request"),
        ("deepseek_v4", "per_request"),
        # encode_images, but its get_input_embeddings never reads cached features back: a
        # cache would run the encoder twice per miss and once per "hit"
        ("deepseek_v41", None),
        ("idefics3", None),
        ("paligemma", None),
        ("gemma3", None),
        ("qwen3_vl", None),
    ],
)
def test_feature_cache_mode_per_family(family, mode):
    assert _mode(family) == mode
