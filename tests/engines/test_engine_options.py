"""engines/options.py: each decode engine's options, read from Settings in one place, with
models.options.<name> over engine.* for that model alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import make_settings

from mlxd.core.errors import ModelLoadError
from mlxd.engines.options import TextEngineOptions, VisionEngineOptions


def test_text_options_take_the_engine_settings_and_the_models_own(tmp_path):
    adapter = tmp_path / "adapter"
    settings = make_settings(
        tmp_path,
        "tiny-llama",
        engine={
            "max_num_seqs": 12,
            "prefill_batch_size": 3,
            "prefill_step_size": 256,
            "max_kv_size": 512,
            "prefix_cache_bytes": 1 << 20,
            "speculative": "draft",
            "draft_model": "a-draft",
            "num_draft_tokens": 4,
        },
        models={
            "adapter_path": str(adapter),
            "trust_remote_code": True,
            "options": {"other": {"max_kv_size": 64, "prefill_step_size": 32}},
        },
    )
    draft = tmp_path / "draft"
    default = TextEngineOptions.from_settings(settings, "tiny-llama", draft_path=draft)
    assert (default.max_num_seqs, default.prefill_batch_size) == (12, 3)
    assert (default.prefill_step_size, default.max_kv_size) == (256, 512)
    assert default.adapter_path == adapter  # models.adapter_path: the default model's
    assert default.trust_remote_code and default.prefix_cache_bytes == 1 << 20
    assert (default.speculative, default.num_draft_tokens, default.draft_path) == (
        "draft",
        4,
        draft,
    )
    assert default.prefix_cache_dir is not None
    assert default.prefix_cache_dir.is_relative_to(settings.engine.prefix_cache_dir)
    other = TextEngineOptions.from_settings(settings, "other")
    assert (other.prefill_step_size, other.max_kv_size) == (32, 64)
    assert other.adapter_path is None and other.max_num_seqs == 12
    # the batch size the model manager resolved (runtime/slots.py) wins
    assert TextEngineOptions.from_settings(settings, "other", max_num_seqs=5).max_num_seqs == 5


@pytest.mark.parametrize("where", ["engine", "model"])
def test_kv_bits_other_than_4_or_8_are_refused_for_a_text_model_naming_where(tmp_path, where):
    sections = (
        {"engine": {"kv_bits": 6}}
        if where == "engine"
        else {"models": {"options": {"m": {"kv_bits": 6}}}}
    )
    settings = make_settings(tmp_path, "tiny-llama", **sections)
    key = "engine.kv_bits" if where == "engine" else "models.options.m.kv_bits"
    with pytest.raises(ModelLoadError, match=key.replace(".", r"\.") + ".*4 or 8"):
        TextEngineOptions.from_settings(settings, "m")


def test_text_models_take_kv_bits_4_and_8_with_the_group_and_start(tmp_path):
    settings = make_settings(
        tmp_path,
        "tiny-llama",
        engine={"kv_bits": 8, "kv_group_size": 32, "kv_quant_start": 100},
        models={"options": {"m": {"kv_bits": 4.0}}},
    )
    o = TextEngineOptions.from_settings(settings, "m")
    assert (o.kv_bits, o.kv_group_size, o.kv_quant_start) == (4, 32, 100)
    assert TextEngineOptions.from_settings(settings, "other").kv_bits == 8


def test_followers_load_the_same_weights_without_caches_or_speculation(tmp_path):
    full = TextEngineOptions(
        max_num_seqs=5,
        prefill_step_size=64,
        max_kv_size=128,
        adapter_path=str(tmp_path),
        prefix_cache_bytes=1 << 20,
        speculative="prompt-lookup",
        dtype="float32",
    )
    assert full.adapter_path == Path(tmp_path)
    follower = TextEngineOptions(**full.for_followers())
    assert (
        follower.max_num_seqs,
        follower.prefill_step_size,
        follower.max_kv_size,
        follower.adapter_path,
        follower.dtype,
    ) == (5, 64, 128, Path(tmp_path), "float32")
    assert follower.prefix_cache_bytes == 0 and follower.speculative == "off"


def test_vision_options_resolve_the_kv_scheme_per_model(tmp_path):
    settings = make_settings(
        tmp_path,
        "tiny-llama",
        engine={"kv_bits": 4},
        vision={"batching": False, "feature_cache_entries": 3},
        models={"options": {"v": {"kv_bits": 3.5, "kv_group_size": 32}}},
    )
    v = VisionEngineOptions.from_settings(settings, "v")
    assert (v.kv_bits, v.kv_quant_scheme, v.kv_group_size) == (3.5, "turboquant", 32)
    assert not v.batching and v.feature_cache_entries == 3
    w = VisionEngineOptions.from_settings(settings, "w")
    assert (w.kv_bits, w.kv_quant_scheme) == (4, "uniform")
    assert VisionEngineOptions().kv_quant_scheme is None
