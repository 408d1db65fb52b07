"""``engine.max_num_seqs: auto`` as a pure function: budget, weights, KV bytes, context."""

from __future__ import annotations

import json

import pytest

from mlxd.config import Settings
from mlxd.core.slots import (
    AUTO_CAP_CPU,
    AUTO_CAP_GPU,
    AUTO_FLOOR,
    auto_max_num_seqs,
    kv_bytes_per_sequence,
    kv_element_bytes,
    provisional,
    resolve,
)

GiB = 1 << 30
# Qwen2.5-0.5B-Instruct's attention shape
QWEN05 = {
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "hidden_size": 896,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
    "sliding_window": 32768,
    "use_sliding_window": False,
}


def test_kv_bytes_are_layers_kv_heads_head_dim_two_and_dtype():
    assert kv_bytes_per_sequence(QWEN05, 1, 2) == 24 * 2 * 64 * 2 * 2 == 12 * 1024
    assert kv_bytes_per_sequence(QWEN05, 4096, 4) == 4096 * 24 * 2 * 64 * 2 * 4
    # the bare sliding_window of a model that does not use one is not applied
    assert kv_bytes_per_sequence(QWEN05, 65536, 2) == 65536 * 12 * 1024


def test_kv_bytes_take_head_dim_nested_text_config_and_unknown_shapes():
    cfg = {
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_size": 8,
    }
    assert kv_bytes_per_sequence(cfg, 10, 4) == 10 * 2 * 2 * 16 * 2 * 4
    assert (
        kv_bytes_per_sequence({"model_type": "llava", "text_config": cfg}, 10, 4)
        == 10 * 2 * 2 * 16 * 2 * 4
    )
    no_kv = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    assert kv_bytes_per_sequence(no_kv, 1, 2) == 2 * 4 * 16 * 2 * 2  # MHA: kv heads = heads
    assert kv_bytes_per_sequence({}, 4096, 2) == 0
    assert kv_bytes_per_sequence({"num_hidden_layers": 2}, 4096, 2) == 0


def test_sliding_windows_bound_their_layers():
    per_layer = 2 * 2 * 8 * 2  # one token, one layer: 2 kv heads x head dim 8 x k,v x 2 B
    base = {
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "sliding_window": 100,
    }
    typed = {
        **base,
        "layer_types": [
            "sliding_attention",
            "full_attention",
            "sliding_attention",
            "linear_attention",
        ],
    }
    assert kv_bytes_per_sequence(typed, 1000, 2) == per_layer * (100 + 1000 + 100)
    gemma3 = {**base, "sliding_window_pattern": 2}  # layers 2 and 4 global
    assert kv_bytes_per_sequence(gemma3, 1000, 2) == per_layer * (100 + 1000 + 100 + 1000)
    assert kv_bytes_per_sequence(gemma3, 50, 2) == per_layer * 50 * 4


@pytest.mark.parametrize(
    ("config", "dtype", "upcast", "want"),
    [
        ({"torch_dtype": "bfloat16"}, "auto", True, 4),  # the CPU runs half weights as float32
        ({"torch_dtype": "bfloat16"}, "auto", False, 2),
        ({"torch_dtype": "float32"}, "native", False, 4),
        ({"torch_dtype": "float32"}, "bfloat16", False, 2),
        ({"torch_dtype": "float16", "quantization": {"bits": 4}}, "auto", True, 2),
        ({}, "native", False, 2),
    ],
)
def test_kv_element_bytes_follow_the_weights_dtype(config, dtype, upcast, want):
    assert kv_element_bytes(config, dtype, upcast) == want


def test_auto_divides_what_the_budget_leaves_by_one_sequence():
    per_seq = 1 << 20
    got = auto_max_num_seqs(
        budget=102 * (1 << 20),
        weight_bytes=1 << 20,
        prefix_cache_bytes=1 << 20,
        kv_bytes_per_seq=per_seq,
        seq_tokens=4096,
        cap=256,
    )
    assert got.value == 90  # (102 - 1 - 1) MiB less 10% for activations, 1 MiB a sequence
    assert got.reason.startswith(
        "auto: 90.0 MiB free for KV (budget 102.0 MiB - weights "
        "1.0 MiB - prefix cache 1.0 MiB - 10% for activations)"
    )
    assert got.reason.endswith("/ 256 B per token / 4096 tokens -> 90 (cap 256)")
    again = auto_max_num_seqs(
        budget=102 * (1 << 20),
        weight_bytes=1 << 20,
        prefix_cache_bytes=1 << 20,
        kv_bytes_per_seq=per_seq,
        seq_tokens=4096,
        cap=256,
    )
    assert again == got  # deterministic


def test_a_smaller_budget_gives_fewer_slots_and_the_range_holds():
    kw = dict(
        weight_bytes=GiB,
        prefix_cache_bytes=GiB,
        kv_bytes_per_seq=48 << 20,
        seq_tokens=4096,
        cap=AUTO_CAP_GPU,
    )
    small, large = (auto_max_num_seqs(budget=b * GiB, **kw).value for b in (4, 8))
    assert AUTO_FLOOR < small < large < AUTO_CAP_GPU
    tiny = auto_max_num_seqs(budget=GiB, **kw)  # less than the weights and cache: floor
    assert tiny.value == AUTO_FLOOR and "0 fit -> 8 (floor 8)" in tiny.reason
    huge = auto_max_num_seqs(budget=1 << 50, **kw)
    assert huge.value == AUTO_CAP_GPU and "fit -> 256 (cap 256)" in huge.reason


def test_the_qwen05_shape_on_an_h200_sized_budget_gets_the_gpu_cap():
    """What the Field description states: 12 KiB a token, 75% of 141 GB: 256."""
    per_seq = kv_bytes_per_sequence(QWEN05, 4096, 2)
    got = auto_max_num_seqs(
        budget=int(141e9 * 0.75),
        weight_bytes=988 << 20,
        prefix_cache_bytes=GiB,
        kv_bytes_per_seq=per_seq,
        seq_tokens=4096,
        cap=AUTO_CAP_GPU,
    )
    assert got.value == 256
    assert "/ 12.0 KiB per token / 4096 tokens -> 1853 fit -> 256 (cap 256)" in got.reason


def test_an_unknown_shape_falls_back_to_32():
    got = auto_max_num_seqs(
        budget=GiB,
        weight_bytes=0,
        prefix_cache_bytes=0,
        kv_bytes_per_seq=0,
        seq_tokens=4096,
        cap=AUTO_CAP_GPU,
    )
    assert got.value == 32 and "no attention shape" in got.reason


def _model(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_quantized_kv_bytes_are_packed_bits_plus_a_scale_and_bias_per_group():
    # head dim 64, bf16: 8 bits is 64 bytes + 2 x 2 bytes a head's vector, 4 bits 32 + 4
    assert kv_bytes_per_sequence(QWEN05, 1, 2, 8) == 24 * 2 * 2 * (64 + 4)
    assert kv_bytes_per_sequence(QWEN05, 1, 2, 4, 32) == 24 * 2 * 2 * (32 + 2 * 2 * 2)


def test_auto_gives_a_quantized_kv_cache_more_slots(tmp_path):
    """kv_bits (engine's or the model's own, uniform only) divides by the quantized bytes."""
    path = _model(tmp_path, QWEN05)
    kw = dict(budget=2 * GiB, weight_bytes=GiB, upcast=False, on_cpu=False)
    base = {"prefix_cache_bytes": 0, "auto_seq_context": 2048}
    plain = resolve(Settings(engine=base), "m", "chat", path, **kw).value
    q8 = resolve(Settings(engine={**base, "kv_bits": 8}), "m", "chat", path, **kw)
    assert q8.value == int(GiB * 0.9) // (2048 * 24 * 2 * 2 * 68) > plain
    s = Settings(engine=base, models={"options": {"m": {"kv_bits": 4}}})
    assert resolve(s, "m", "chat", path, **kw).value > q8.value
    assert resolve(s, "other", "chat", path, **kw).value == plain
    turbo = Settings(engine={**base, "kv_bits": 3.5})  # turboquant: not modelled, full size
    assert resolve(turbo, "m", "vision", path, **kw).value <= plain


def test_resolve_reads_the_settings(tmp_path):
    """A number is used as it is (per model over the engine's); auto sizes for
    min(context, auto_seq_context, max_kv_size) tokens, capped by backend."""
    path = _model(tmp_path, QWEN05)
    kw = dict(budget=2 * GiB, weight_bytes=GiB, upcast=False, on_cpu=False)
    s = Settings(
        engine={"max_num_seqs": 12}, models={"options": {"other": {"max_num_seqs": "auto"}}}
    )
    fixed = resolve(s, "m", "chat", path, **kw)
    assert (fixed.value, fixed.reason) == (12, "engine.max_num_seqs: 12")
    assert resolve(s, "other", "chat", path, **kw).reason.startswith("auto: ")
    s = Settings(models={"options": {"m": {"max_num_seqs": 3}}})
    assert resolve(s, "m", "chat", path, **kw).reason == "models.options.m.max_num_seqs: 3"

    s = Settings(engine={"prefix_cache_bytes": 0, "auto_seq_context": 2048})
    got = resolve(s, "m", "chat", path, **kw)
    assert got.value == int(GiB * 0.9) // (2048 * 12 * 1024) == 38
    assert "/ 2048 tokens ->" in got.reason
    bounded = Settings(engine={"prefix_cache_bytes": 0, "max_kv_size": 512})
    assert resolve(bounded, "m", "chat", path, **kw).value == 153  # 512-token sequences
    assert resolve(bounded, "m", "chat", path, **{**kw, "on_cpu": True}).value == AUTO_CAP_CPU
    (tmp_path / "short").mkdir()
    short = _model(tmp_path / "short", {**QWEN05, "max_position_embeddings": 1024})
    assert "/ 1024 tokens ->" in resolve(Settings(), "m", "chat", short, **kw).reason
    group = Settings(engine={"prefix_cache_bytes": 0, "tensor_parallel": 2})
    assert resolve(group, "m", "chat", path, **kw).value == int(GiB * 0.9) // (
        4096 * 6 * 1024
    )  # a rank holds half the KV heads


def test_provisional_is_the_setting_or_the_cap():
    assert provisional(Settings(engine={"max_num_seqs": 5}), on_cpu=False) == 5
    assert provisional(Settings(), on_cpu=False) == AUTO_CAP_GPU
    assert provisional(Settings(), on_cpu=True) == AUTO_CAP_CPU
