"""Import llama-architecture GGUF files into standard MLX model directories.

GGUF bundles weights, hyper-parameters and the tokenizer in one file, while the
rest of mlxd (and ``mlx_lm.load``) expects a Hugging Face style directory.
Converting once at import time keeps a single loading path for every model the
server runs, instead of teaching each engine about GGUF.
"""

from __future__ import annotations

import json
import mmap
import struct
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

__all__ = ["GGUFImportError", "import_gguf"]


class GGUFImportError(Exception):
    """Raised when a GGUF file cannot be turned into a correct MLX model.

    A distinct type lets callers tell "this file is not something we can serve"
    (report to the user) apart from I/O or programming errors (bugs).
    """


# ggml tensor type ids, as written in the GGUF tensor-info table.
_GGML_TYPE_NAMES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
    9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K",
    15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S",
    20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16",
    26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0",
    35: "TQ2_0", 39: "MXFP4",
}
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})
# GGUF block formats that are exactly MLX affine quantization with group 32:
# Q4_0 is d*(q-8), Q4_1 is d*q+m, Q8_0 is d*q with signed q.
_QUANT_BITS: dict[str, int] = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
_GROUP_SIZE = 32
_SUPPORTED_TYPES = _FLOAT_TYPES | frozenset(_QUANT_BITS)

_DTYPES: dict[str, mx.Dtype] = {
    "float32": mx.float32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
}

# GGUF metadata value types -> struct format (scalars only).
_SCALAR_FORMATS: dict[int, str] = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}
_NUMPY_TYPES: dict[int, str] = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
    10: "<u8", 11: "<i8", 12: "<f8",
}
_GGUF_STRING, _GGUF_ARRAY = 8, 9

# llama.cpp token types (tokenizer.ggml.token_type).
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED, _TT_UNUSED, _TT_BYTE = 1, 2, 3, 4, 5, 6

_LAYER_NAMES: dict[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Precomputed rotary tables some converters emit; mlx-lm recomputes them.
_IGNORED_SUFFIXES = ("attn_rot_embd",)

# Pre-tokenizer regexes from llama.cpp / the original HF tokenizer.json files.
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGIT_SPLIT_PRE = frozenset({"smollm", "starcoder", "refact"})
_GPT2_PRE = frozenset({"gpt-2", "gpt2", "default"})
_LLAMA3_PRE = frozenset({"llama-bpe", "llama3", "llama-v3"})


# --------------------------------------------------------------------------- #
# GGUF header
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major (MLX/numpy) order, i.e. GGUF dims reversed
    type_name: str
    offset: int  # absolute file offset of the tensor data


class _Reader:
    """Cursor over the GGUF header; mx.load hides tensor types and offsets we need."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        raw = self.buf[self.pos : self.pos + n]
        if len(raw) != n:
            raise GGUFImportError("truncated GGUF header (string runs past end of file)")
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _GGUF_STRING:
            return self.string()
        if vtype == _GGUF_ARRAY:
            item_type = self.scalar("<I")
            count = self.scalar("<Q")
            if item_type in _NUMPY_TYPES:
                dt = np.dtype(_NUMPY_TYPES[item_type])
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).copy()
                self.pos += count * dt.itemsize
                return arr
            return [self.value(item_type) for _ in range(count)]
        if vtype == 6:
            # Shortest float32 repr, so config.json says 1e-05 rather than 9.9999997e-06.
            return float(str(np.float32(self.scalar("<f"))))
        if vtype in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[vtype])
        raise GGUFImportError(f"unknown GGUF metadata value type {vtype}")


def _read_header(path: Path) -> tuple[dict[str, Any], list[_TensorInfo]]:
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:  # empty file
            raise GGUFImportError(f"{path} is not a GGUF file (empty)") from e
    try:
        r = _Reader(buf)
        if buf[:4] != b"GGUF":
            raise GGUFImportError(f"{path} is not a GGUF file (bad magic {buf[:4]!r})")
        r.pos = 4
        version = r.scalar("<I")
        if version not in (2, 3):
            raise GGUFImportError(
                f"unsupported GGUF version {version} (only little-endian v2/v3 are supported)"
            )
        n_tensors = r.scalar("<Q")
        n_kv = r.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = r.string()
            metadata[key] = r.value(r.scalar("<I"))
        raw_infos = []
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.scalar("<I")
            dims = [r.scalar("<Q") for _ in range(n_dims)]
            type_id = r.scalar("<I")
            offset = r.scalar("<Q")
            raw_infos.append((name, tuple(reversed(dims)), type_id, offset))
        alignment = int(metadata.get("general.alignment", 32))
        data_start = r.pos + (-r.pos) % alignment
    except struct.error as e:
        raise GGUFImportError(f"truncated or corrupt GGUF header in {path}: {e}") from e
    finally:
        buf.close()
    infos = [
        _TensorInfo(name, shape, _GGML_TYPE_NAMES.get(tid, f"type{tid}"), data_start + off)
        for name, shape, tid, off in raw_infos
    ]
    return metadata, infos


# --------------------------------------------------------------------------- #
# Weights
# --------------------------------------------------------------------------- #


def _hf_name(gguf_name: str) -> str | None:
    """Map a llama.cpp tensor name to the mlx-lm llama parameter name."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        mapped = _LAYER_NAMES.get(parts[2])
        return f"model.layers.{parts[1]}.{mapped}.{suffix}" if mapped else None
    if len(parts) == 1 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{suffix}"
    return None


def _read_bf16(path: Path, info: _TensorInfo) -> mx.array:
    # mx.load narrows BF16 to float16 (losing range), so read the raw bits instead.
    count = int(np.prod(info.shape))
    raw = np.fromfile(path, dtype="<u2", count=count, offset=info.offset)
    if raw.size != count:
        raise GGUFImportError(f"tensor {info.name} runs past end of file")
    return mx.array(raw.reshape(info.shape)).view(mx.bfloat16)


def _load_weights(
    path: Path, infos: list[_TensorInfo], dtype: str
) -> tuple[dict[str, mx.array], dict[str, int], int]:
    """Return HF-named weights, per-module quantization bits, and the parameter count."""
    try:
        raw = mx.load(str(path))
    except (RuntimeError, ValueError) as e:
        raise GGUFImportError(f"MLX could not read tensors from {path}: {e}") from e
    target = _DTYPES.get(dtype)

    weights: dict[str, mx.array] = {}
    quant_bits: dict[str, int] = {}
    n_params = 0
    for info in infos:
        base = info.name.rsplit(".", 1)[0]
        if base == "rope_freqs" or base.endswith(_IGNORED_SUFFIXES):
            continue
        hf = _hf_name(info.name)
        if hf is None:
            raise GGUFImportError(f"unexpected tensor {info.name!r} in a llama GGUF file")
        n_params += int(np.prod(info.shape))
        if info.type_name in _QUANT_BITS:
            bits = _QUANT_BITS[info.type_name]
            w, scales, biases = (raw[f"{base}.{k}"] for k in ("weight", "scales", "biases"))
            module = hf[: -len(".weight")]
            if dtype == "native":
                weights[hf] = w
                weights[f"{module}.scales"] = scales
                weights[f"{module}.biases"] = biases
                quant_bits[module] = bits
            else:
                # Dequantize in float32 so float16 scales do not round the products.
                deq = mx.dequantize(
                    w,
                    scales.astype(mx.float32),
                    biases.astype(mx.float32),
                    group_size=_GROUP_SIZE,
                    bits=bits,
                )
                weights[hf] = deq.astype(target)
        else:
            if target is not None:
                out_dtype = target
            elif len(info.shape) == 1:
                # Native mode: norms and biases stay float32 because they set the
                # activation dtype (x * f32 weight promotes to f32). With float16
                # activations MLX's CPU quantized matmul was ~35x slower and flipped
                # SmolLM2's greedy answer; the norms themselves cost a few KB.
                out_dtype = mx.float32
            else:
                out_dtype = mx.float16
            src = _read_bf16(path, info) if info.type_name == "BF16" else raw[info.name]
            weights[hf] = src.astype(out_dtype)
        # Evaluate per tensor and drop the source so peak memory stays bounded.
        mx.eval(weights[hf])
        for key in (info.name, f"{base}.scales", f"{base}.biases"):
            raw.pop(key, None)
    return weights, quant_bits, n_params


# --------------------------------------------------------------------------- #
# Config
# --------------------------------------------------------------------------- #


def _meta(md: dict[str, Any], key: str, default: Any = ...) -> Any:
    if key in md:
        value = md[key]
        return value.item() if isinstance(value, np.generic) else value
    if default is ...:
        raise GGUFImportError(f"GGUF metadata is missing required key {key!r}")
    return default


def _llama3_rope_scaling(
    rope_freqs: np.ndarray, head_dim: int, base: float
) -> dict[str, Any]:
    """Recover Llama 3.x rope_scaling from llama.cpp's per-dimension rope_freqs factors.

    mlx-lm cannot take a raw frequency table, so we search the (few) parameter sets
    Meta ships and refuse anything that does not reproduce the table.
    """
    factor = float(np.max(rope_freqs))
    periods = base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelens = 2 * np.pi * periods
    for old_ctx in (8192, 4096, 2048, 16384, 32768, 65536, 131072):
        for low, high in ((1.0, 4.0), (1.0, 2.0), (1.0, 8.0), (2.0, 4.0)):
            low_wl, high_wl = old_ctx / low, old_ctx / high
            p = np.where(wavelens > low_wl, periods * factor, periods)
            medium = (wavelens > high_wl) & (wavelens < low_wl)
            smooth = (old_ctx / wavelens - low) / (high - low)
            p = np.where(medium, p / ((1 - smooth) / factor + smooth), p)
            if np.allclose(p / periods, rope_freqs, rtol=1e-3, atol=1e-4):
                return {
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low,
                    "high_freq_factor": high,
                    "original_max_position_embeddings": old_ctx,
                }
    raise GGUFImportError(
        "rope_freqs.weight does not match any known Llama 3 rope scaling; cannot import"
    )


def _build_config(
    md: dict[str, Any],
    infos: list[_TensorInfo],
    path: Path,
    vocab_size: int,
) -> dict[str, Any]:
    arch = _meta(md, "general.architecture")
    p = f"{arch}."
    if _meta(md, p + "expert_count", 0):
        raise GGUFImportError(
            "mixture-of-experts llama GGUF (e.g. Mixtral) is not supported by the importer"
        )
    hidden = int(_meta(md, p + "embedding_length"))
    n_heads = int(_meta(md, p + "attention.head_count"))
    n_kv = int(_meta(md, p + "attention.head_count_kv", n_heads))
    head_dim = int(_meta(md, p + "attention.key_length", hidden // n_heads))
    if int(_meta(md, p + "attention.value_length", head_dim)) != head_dim:
        raise GGUFImportError("attention.value_length != attention.key_length is not supported")
    rope_dim = int(_meta(md, p + "rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise GGUFImportError(
            f"partial rotary embeddings (rope.dimension_count={rope_dim}, "
            f"head_dim={head_dim}) are not supported for llama"
        )
    rope_theta = float(_meta(md, p + "rope.freq_base", 10000.0))
    names = {i.name for i in infos}
    embd = next((i for i in infos if i.name == "token_embd.weight"), None)
    if embd is None:
        raise GGUFImportError("GGUF file has no token_embd.weight tensor")
    if embd.shape[0] != vocab_size:
        warnings.warn(
            f"token list has {vocab_size} entries but token_embd has {embd.shape[0]} rows; "
            "using the embedding size",
            stacklevel=3,
        )
        vocab_size = embd.shape[0]

    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(_meta(md, p + "block_count")),
        "intermediate_size": int(_meta(md, p + "feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "rms_norm_eps": float(_meta(md, p + "attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(_meta(md, p + "context_length")),
        "rope_theta": rope_theta,
        # llama.cpp permutes Q/K rows so that rotary pairs are adjacent; reading them
        # with the interleaved ("traditional") rotary layout is equivalent to undoing
        # the permutation, and keeps quantized rows untouched.
        "rope_traditional": True,
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": any(n.endswith("attn_q.bias") for n in names),
        "mlp_bias": any(n.endswith("ffn_up.bias") for n in names),
    }
    if head_dim != hidden // n_heads:
        config["head_dim"] = head_dim

    scaling_type = _meta(md, p + "rope.scaling.type", "none")
    factor = float(_meta(md, p + "rope.scaling.factor", 0.0) or 0.0)
    legacy_linear = float(_meta(md, p + "rope.scale_linear", 1.0))
    if scaling_type == "none" and legacy_linear != 1.0:  # pre-2024 converters
        scaling_type, factor = "linear", legacy_linear
    if "rope_freqs.weight" in names:
        info = next(i for i in infos if i.name == "rope_freqs.weight")
        if info.type_name != "F32":
            raise GGUFImportError(f"rope_freqs.weight has unsupported type {info.type_name}")
        freqs = np.fromfile(path, dtype="<f4", count=info.shape[-1], offset=info.offset)
        if not np.allclose(freqs, 1.0):
            config["rope_scaling"] = _llama3_rope_scaling(freqs, head_dim, rope_theta)
    elif scaling_type == "linear" and factor and factor != 1.0:
        config["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    elif scaling_type == "yarn" and factor:
        config["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": int(
                _meta(md, p + "rope.scaling.original_context_length", 0)
                or config["max_position_embeddings"]
            ),
        }
    elif scaling_type not in ("none", "linear", "yarn"):
        raise GGUFImportError(f"unsupported rope scaling type {scaling_type!r}")
    return config


# --------------------------------------------------------------------------- #
# Tokenizer
# --------------------------------------------------------------------------- #


@dataclass
class _TokenizerFiles:
    tokenizer: Tokenizer
    config: dict[str, Any]
    special_tokens_map: dict[str, Any]
    eos_ids: list[int]
    bos_id: int | None
    pad_id: int | None


def _token_id(md: dict[str, Any], key: str, n_tokens: int) -> int | None:
    value = _meta(md, f"tokenizer.ggml.{key}", None)
    if value is None:
        return None
    value = int(value)
    # Converters write -1 / 0xFFFFFFFF for "no such token".
    return value if 0 <= value < n_tokens else None


def _spm_merges(
    tokens: list[str], vocab: dict[str, int], scores: np.ndarray, mergeable: np.ndarray
) -> list[tuple[str, str]]:
    """Derive BPE merges from a SentencePiece vocabulary.

    GGUF stores only pieces and scores for SentencePiece models; SentencePiece BPE
    always merges the pair whose result scores highest, so ranking every split of
    every piece by the piece's score reproduces it with a standard BPE model.
    """
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for idx, piece in enumerate(tokens):
        if not mergeable[idx] or len(piece) < 2:
            continue
        score = float(scores[idx])
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None and mergeable[li] and mergeable[ri]:
                ranked.append((-score, idx, li, ri, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _build_tokenizer(md: dict[str, Any], context_length: int) -> _TokenizerFiles:
    kind = _meta(md, "tokenizer.ggml.model", None)
    if kind is None:
        raise GGUFImportError("GGUF metadata is missing 'tokenizer.ggml.model'")
    tokens: list[str] = list(_meta(md, "tokenizer.ggml.tokens"))
    n = len(tokens)
    token_type = np.asarray(
        md.get("tokenizer.ggml.token_type", np.full(n, _TT_NORMAL)), dtype=np.int64
    )
    if token_type.shape != (n,):
        raise GGUFImportError("tokenizer.ggml.token_type length does not match the token list")

    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # first occurrence wins, like llama.cpp's token_to_id

    bos_id = _token_id(md, "bos_token_id", n)
    eos_id = _token_id(md, "eos_token_id", n)
    unk_id = _token_id(md, "unknown_token_id", n)
    pad_id = _token_id(md, "padding_token_id", n)
    eot_id = _token_id(md, "eot_token_id", n)
    eom_id = _token_id(md, "eom_token_id", n)

    if kind == "gpt2":
        pre = _meta(md, "tokenizer.ggml.pre", "default")
        merges = []
        for m in _meta(md, "tokenizer.ggml.merges"):
            cut = m.find(" ", 1)  # llama.cpp splits at the first space after char 0
            if cut < 0:
                raise GGUFImportError(f"malformed BPE merge {m!r}")
            merges.append((m[:cut], m[cut + 1 :]))
        byte_level = pre_tokenizers.ByteLevel(
            add_prefix_space=False, trim_offsets=True, use_regex=pre not in _LLAMA3_PRE
        )
        if pre in _DIGIT_SPLIT_PRE:
            pre_tok = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        elif pre in _GPT2_PRE:
            if pre == "default":
                warnings.warn(
                    "GGUF has no tokenizer.ggml.pre; assuming GPT-2 pre-tokenization",
                    stacklevel=3,
                )
            pre_tok = byte_level
        elif pre in _LLAMA3_PRE:
            pre_tok = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated"), byte_level]
            )
        else:
            raise GGUFImportError(
                f"unsupported BPE pre-tokenizer {pre!r} (supported: "
                f"{sorted(_DIGIT_SPLIT_PRE | _GPT2_PRE | _LLAMA3_PRE)})"
            )
        tok = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=merges,
                fuse_unk=False,
                byte_fallback=False,
                ignore_merges=pre in _LLAMA3_PRE,
            )
        )
        tok.pre_tokenizer = pre_tok
        tok.decoder = decoders.ByteLevel()
        add_bos_default = False
    elif kind == "llama":
        scores = np.asarray(md.get("tokenizer.ggml.scores", -np.arange(n)), dtype=np.float64)
        if scores.shape != (n,):
            raise GGUFImportError("tokenizer.ggml.scores length does not match the token list")
        mergeable = (token_type == _TT_NORMAL) | (token_type == _TT_USER_DEFINED)
        merges = _spm_merges(tokens, vocab, scores, mergeable)
        add_prefix = bool(_meta(md, "tokenizer.ggml.add_space_prefix", True))
        tok = Tokenizer(
            models.BPE(
                vocab=vocab,
                merges=merges,
                unk_token=tokens[unk_id] if unk_id is not None else None,
                fuse_unk=True,
                byte_fallback=True,
            )
        )
        replace = normalizers.Replace(" ", "\u2581")
        tok.normalizer = (
            normalizers.Sequence([normalizers.Prepend("\u2581"), replace])
            if add_prefix
            else replace
        )
        dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_prefix:
            dec.append(decoders.Strip(content=" ", left=1, right=0))
        tok.decoder = decoders.Sequence(dec)
        add_bos_default = True
    else:
        raise GGUFImportError(
            f"unsupported tokenizer model {kind!r} (supported: 'gpt2' byte-level BPE, "
            "'llama' SentencePiece BPE)"
        )

    # Control/user-defined tokens must be added tokens so that markers such as
    # <|im_start|> are matched verbatim as one id instead of being split by BPE.
    named = {i for i in (bos_id, eos_id, unk_id, pad_id, eot_id, eom_id) if i is not None}
    added: list[AddedToken] = []
    added_decoder: dict[str, dict[str, Any]] = {}
    for i in range(n):
        tt = int(token_type[i])
        if tt not in (_TT_CONTROL, _TT_USER_DEFINED, _TT_UNKNOWN) and i not in named:
            continue
        if vocab.get(tokens[i]) != i:
            continue  # duplicate string; unreachable by text anyway
        special = tt != _TT_USER_DEFINED
        added.append(AddedToken(tokens[i], special=special, normalized=False))
        added_decoder[str(i)] = {
            "content": tokens[i],
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])

    add_bos = bool(_meta(md, "tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(_meta(md, "tokenizer.ggml.add_eos_token", False))
    bos_tok = tokens[bos_id] if add_bos and bos_id is not None else None
    eos_tok = tokens[eos_id] if add_eos and eos_id is not None else None
    if bos_tok is not None or eos_tok is not None:
        def seq(piece: str, type_id: int) -> list[str]:
            return [
                *([f"{bos_tok}:{type_id}"] if bos_tok is not None else []),
                f"{piece}:{type_id}",
                *([f"{eos_tok}:{type_id}"] if eos_tok is not None else []),
            ]

        specials = {tokens[i]: i for i in (bos_id, eos_id) if i is not None}
        tok.post_processor = processors.TemplateProcessing(
            single=seq("$A", 0),
            pair=seq("$A", 0) + seq("$B", 1),
            special_tokens=[
                (t, i) for t, i in specials.items() if t in (bos_tok, eos_tok)
            ],
        )

    def name(i: int | None) -> str | None:
        return tokens[i] if i is not None else None

    special_map: dict[str, Any] = {
        k: name(i)
        for k, i in (
            ("bos_token", bos_id),
            ("eos_token", eos_id),
            ("unk_token", unk_id),
            ("pad_token", pad_id),
        )
        if i is not None
    }
    extra = [
        tokens[i]
        for i in range(n)
        if int(token_type[i]) == _TT_CONTROL and i not in {bos_id, eos_id, unk_id, pad_id}
        and vocab.get(tokens[i]) == i
    ]
    if extra:
        special_map["additional_special_tokens"] = extra

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(bos_id),
        "eos_token": name(eos_id),
        "unk_token": name(unk_id),
        "pad_token": name(pad_id),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "model_max_length": context_length,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added_decoder,
    }
    if extra:
        config["additional_special_tokens"] = extra
    template = _meta(md, "tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = template

    eos_ids = list(dict.fromkeys(i for i in (eos_id, eot_id, eom_id) if i is not None))
    return _TokenizerFiles(tok, config, special_map, eos_ids, bos_id, pad_id)


# --------------------------------------------------------------------------- #
# Entry point
# --------------------------------------------------------------------------- #


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def import_gguf(gguf_path: str | Path, out_dir: str | Path, *, dtype: str = "float32") -> dict:
    """Convert a llama GGUF file into an MLX model directory loadable by ``mlx_lm.load``.

    ``out_dir`` must be new or empty: the caller stages into a scratch directory and
    renames it into place, so a failed import never leaves a half-written model that
    the server would later try to load.

    ``dtype`` is "float32", "float16" or "bfloat16" to dequantize everything, or
    "native" to keep Q4_0/Q4_1/Q8_0 tensors as MLX affine quantization (group 32),
    which is lossless because those formats are affine already. The remaining matrices
    are stored in float16; 1-D tensors (norms) stay float32 so activations run in
    float32, which keeps native output identical to the dequantized model.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if dtype not in _DTYPES and dtype != "native":
        raise ValueError(f"dtype must be one of {[*_DTYPES, 'native']}, got {dtype!r}")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"output directory {out_dir} is not empty")

    md, infos = _read_header(gguf_path)
    arch = md.get("general.architecture")
    if arch != "llama":
        raise GGUFImportError(
            f"unsupported GGUF architecture {arch!r}; only 'llama' can be imported"
        )
    type_counts = Counter(info.type_name for info in infos)
    unsupported = sorted(t for t in type_counts if t not in _SUPPORTED_TYPES)
    if unsupported:
        raise GGUFImportError(
            f"unsupported GGUF tensor type(s) {unsupported}; supported: "
            f"{sorted(_SUPPORTED_TYPES)}"
        )
    for info in infos:
        if info.type_name in _QUANT_BITS and (
            len(info.shape) != 2 or not info.name.endswith(".weight")
        ):
            raise GGUFImportError(
                f"quantized tensor {info.name} has shape {info.shape}; only 2-D weights "
                "can be quantized"
            )

    context_length = int(_meta(md, "llama.context_length"))
    tok_files = _build_tokenizer(md, context_length)
    config = _build_config(md, infos, gguf_path, len(md["tokenizer.ggml.tokens"]))
    weights, quant_bits, n_params = _load_weights(gguf_path, infos, dtype)

    quantization: dict[str, int] | None = None
    if quant_bits:
        bits_count = Counter(quant_bits.values())
        default_bits = bits_count.most_common(1)[0][0]
        quantization = {"group_size": _GROUP_SIZE, "bits": default_bits}
        q_config: dict[str, Any] = {**quantization, "mode": "affine"}
        # mlx-lm consults per-module entries before the default, which lets a Q8_0
        # embedding sit next to Q4_x projections.
        for module, bits in sorted(quant_bits.items()):
            if bits != default_bits:
                q_config[module] = {"group_size": _GROUP_SIZE, "bits": bits, "mode": "affine"}
        config["quantization"] = q_config
        config["quantization_config"] = q_config
    config["torch_dtype"] = "float16" if dtype == "native" else dtype
    if tok_files.bos_id is not None:
        config["bos_token_id"] = tok_files.bos_id
    if tok_files.eos_ids:
        config["eos_token_id"] = (
            tok_files.eos_ids[0] if len(tok_files.eos_ids) == 1 else tok_files.eos_ids
        )

    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    _write_json(out_dir / "config.json", config)
    tok_files.tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tok_files.config)
    _write_json(out_dir / "special_tokens_map.json", tok_files.special_tokens_map)
    generation: dict[str, Any] = {}
    if tok_files.bos_id is not None:
        generation["bos_token_id"] = tok_files.bos_id
    if tok_files.eos_ids:
        generation["eos_token_id"] = (
            tok_files.eos_ids[0] if len(tok_files.eos_ids) == 1 else tok_files.eos_ids
        )
    if tok_files.pad_id is not None:
        generation["pad_token_id"] = tok_files.pad_id
    _write_json(out_dir / "generation_config.json", generation)

    return {
        "architecture": arch,
        "quantization": quantization,
        "dtype": dtype,
        "num_parameters": n_params,
        "source_tensor_types": dict(sorted(type_counts.items())),
    }
