"""GGUF import beyond llama: K-quants and the qwen2/qwen3/gemma2/gemma3/phi3 architectures.

Fixtures are written by gguf's own GGUFWriter (tests/fixtures/gguf_writer.py); every check
compares against gguf.quants.dequantize, llama.cpp's reference decoder.
"""

from __future__ import annotations

import json
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from fixtures.gguf_writer import (
    ARCHS,
    K_DIMS,
    arch_tensors,
    bpe_vocab,
    encode_tensor,
    llama_metadata,
    write_gguf,
)
from gguf import GGMLQuantizationType
from mlx import nn
from mlx_lm.generate import generate_step
from mlx_lm.utils import load as mlx_lm_load

from mlxd.store.gguf import import_gguf
from mlxd.store.gguf_weights import NATIVE_BITS, convert_tensor, pack_codes

Q = GGMLQuantizationType
EXPECTED_BITS = {
    "Q4_0": 4,
    "Q4_1": 4,
    "Q5_0": 5,
    "Q5_1": 5,
    "Q8_0": 8,
    "Q4_K": 4,
    "Q5_K": 5,
    "Q6_K": 8,
}
LOSSLESS = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K"}


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_pack_codes_is_mlx_layout(bits):
    codes = np.random.default_rng(bits).integers(0, 1 << bits, (3, 64), dtype=np.uint8)
    packed = mx.array(pack_codes(codes, bits))
    ones, zeros = mx.ones((3, 2)), mx.zeros((3, 2))
    got = mx.dequantize(packed, ones, zeros, group_size=32, bits=bits)
    np.testing.assert_array_equal(np.array(got), codes.astype(np.float32))


@pytest.mark.parametrize("type_name", sorted(EXPECTED_BITS))
def test_quantized_tensor_conversion(type_name):
    rng = np.random.default_rng(0)
    x = rng.normal(0, 0.05, (6, 512)).astype(np.float32)
    raw, ref = encode_tensor(x, type_name, rng)
    qtype = Q[type_name]
    assert NATIVE_BITS[qtype] == EXPECTED_BITS[type_name]

    f32 = convert_tensor(raw, qtype, x.shape, "float32")
    assert f32.bits is None and f32.weight.dtype == mx.float32
    np.testing.assert_array_equal(np.array(f32.weight), ref)

    nat = convert_tensor(raw, qtype, x.shape, "native")
    assert nat.bits == EXPECTED_BITS[type_name]
    got = np.array(
        mx.dequantize(
            nat.weight,
            nat.scales.astype(mx.float32),
            nat.biases.astype(mx.float32),
            group_size=32,
            bits=nat.bits,
        )
    )
    groups, err = ref.reshape(-1, 32), np.abs(got - ref).reshape(-1, 32).max(axis=1)
    if type_name in LOSSLESS:  # the block's own affine grid, kept: float rounding only
        assert (err <= 1e-6 * np.abs(groups).max(axis=1) + 1e-9).all(), err.max()
    else:  # Q6_K -> 8 bits: within one 8-bit step (mx.quantize snaps an edge value exactly,
        # so not half a step) plus float16 rounding of scale and bias
        span = groups.max(axis=1) - groups.min(axis=1)
        assert (err <= span / 255 + 2e-3 * np.abs(groups).max(axis=1)).all()
        assert err.max() > 0  # really re-quantized, not passed through


def _import_both(tmp_path, arch, weight_type, *, tied=True):
    # Gemma 3 alternates 5 sliding-window layers with a global one: it needs 6 layers
    dims = replace(K_DIMS, layers=6) if arch == "gemma3" else K_DIMS
    tensors = arch_tensors(arch, weight_type, dims=dims, tied=tied)
    path = tmp_path / f"{arch}.gguf"
    decoded = write_gguf(path, llama_metadata(arch, dims), tensors)
    info = import_gguf(path, tmp_path / "native", dtype="native")
    import_gguf(path, tmp_path / "f32", dtype="float32")
    return tensors, decoded, info


# A Q4_K_M-like mix: Q6_K for some down/value projections and the output, Q5_K elsewhere.
Q4_K_M = {
    "blk.0.ffn_down": "Q6_K",
    "blk.1.attn_v": "Q6_K",
    "output": "Q6_K",
    "blk.1.ffn_down": "Q5_K",
    "": "Q4_K",
}
MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
}


@pytest.mark.parametrize("arch", ARCHS)
def test_architecture_imports_and_generates(tmp_path, arch):
    tied = arch in ("gemma2", "qwen2")
    tensors, decoded, info = _import_both(tmp_path, arch, Q4_K_M, tied=tied)
    assert info["architecture"] == arch
    assert info["quantization"] == {"group_size": 32, "bits": 4}
    assert info["num_parameters"] == sum(x.size for _, x, _ in tensors)

    config = json.loads((tmp_path / "native" / "config.json").read_text())
    assert config["model_type"] == MODEL_TYPES[arch]
    assert config["rope_traditional"] is (arch == "llama")  # only llama's Q/K are permuted
    assert config["quantization"]["model.layers.0.mlp.down_proj"]["bits"] == 8
    assert config["quantization"]["model.layers.1.mlp.down_proj"]["bits"] == 5

    # float32 import: every tensor is the reference decode, under its mlx-lm name; Gemma's
    # norms (stored by llama.cpp as 1 + w) come back as w
    weights = mx.load(str(tmp_path / "f32" / "model.safetensors"))
    assert len(weights) == len(tensors)
    norm = "model.layers.1.input_layernorm.weight"
    shift = 1.0 if arch.startswith("gemma") else 0.0
    np.testing.assert_allclose(
        np.array(weights[norm]), decoded["blk.1.attn_norm.weight"] - shift, rtol=1e-6
    )
    if arch == "phi3":
        np.testing.assert_array_equal(
            np.array(weights["model.layers.0.self_attn.qkv_proj.weight"]),
            decoded["blk.0.attn_qkv.weight"],
        )
    else:
        np.testing.assert_array_equal(
            np.array(weights["model.layers.0.self_attn.k_proj.weight"]),
            decoded["blk.0.attn_k.weight"],
        )
    if arch == "qwen2":
        np.testing.assert_array_equal(
            np.array(weights["model.layers.1.self_attn.q_proj.bias"]), decoded["blk.1.attn_q.bias"]
        )
    if arch in ("qwen3", "gemma3"):
        np.testing.assert_allclose(
            np.array(weights["model.layers.0.self_attn.q_norm.weight"]),
            decoded["blk.0.attn_q_norm.weight"] - shift,
            rtol=1e-6,
        )

    native, tok = mlx_lm_load(str(tmp_path / "native"))
    reference, _ = mlx_lm_load(str(tmp_path / "f32"))
    layer = native.model.layers[0]
    proj = layer.self_attn.qkv_proj if arch == "phi3" else layer.self_attn.q_proj
    assert isinstance(proj, nn.QuantizedLinear) and (proj.bits, proj.group_size) == (4, 32)
    assert layer.mlp.down_proj.bits == 8

    # native differs from the reference only where Q6_K became 8-bit
    x = mx.array([tok.encode("hello world", add_special_tokens=False)])
    ref_logits = np.array(reference(x))
    np.testing.assert_allclose(
        np.array(native(x)), ref_logits, atol=2e-2 * np.abs(ref_logits).max()
    )

    prompt = mx.array(tok.encode("<|im_start|>user\nhello<|im_end|>\n"))
    tokens = [int(token) for token, _logprobs in generate_step(prompt, native, max_tokens=5)]
    assert len(tokens) == 5 and all(0 <= t < len(bpe_vocab()) for t in tokens)
    assert isinstance(tok.decode(tokens), str)


@pytest.mark.parametrize("weight_type", ["Q8_0", "F16"])
def test_qwen2_tokenizer_and_other_types(tmp_path, weight_type):
    tensors = arch_tensors("qwen2", weight_type)
    path = tmp_path / "q.gguf"
    write_gguf(path, llama_metadata("qwen2"), tensors)
    import_gguf(path, tmp_path / "out", dtype="native")
    model, tok = mlx_lm_load(str(tmp_path / "out"))
    vocab = bpe_vocab()
    # qwen2 pre-tokenizer: digits one at a time, merges applied, markers kept whole
    ids = tok.encode("hello 42<|im_end|>", add_special_tokens=False)
    assert ids == [
        vocab.index("hello"),
        vocab.index("Ġ"),
        vocab.index("4"),
        vocab.index("2"),
        vocab.index("<|im_end|>"),
    ]
    assert model(mx.array([ids])).shape == (1, len(ids), len(vocab))
