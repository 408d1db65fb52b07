"""GGUF architectures -> mlx-lm (Hugging Face style) parameter names and ``config.json``.

llama.cpp renames every tensor (``blk.3.attn_q.weight``) and keeps hyper-parameters under
``<arch>.*`` keys; mlx-lm wants the original Hugging Face names and config. The mapping is
per architecture, and so are the few places where llama.cpp changed the numbers on the way
in (Gemma's ``1 + w`` norms, Llama's permuted Q/K rows); both are undone or accounted for
here so the weights stay what the file holds.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlxd.store.gguf_meta import GGUFImportError, meta

__all__ = ["ARCHS", "Arch", "build_config", "llama3_rope_scaling"]

_ATTN_MLP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_PRE_POST_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA_NORMS = {  # Gemma 2/3 normalise before and after both attention and MLP
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3 = {  # fused projections
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",
    "ffn_down": "mlp.down_proj",
    **_PRE_POST_NORMS,
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tables llama.cpp stores as tensors that mlx-lm takes from config.json (or recomputes).
_CONFIG_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")


@dataclass(frozen=True)
class Arch:
    """How one GGUF ``general.architecture`` maps onto an mlx-lm model."""

    model_type: str
    hf_class: str
    layer_names: dict[str, str]
    # Gemma's RMSNorm multiplies by (1 + w); llama.cpp stores 1 + w, mlx-lm wants w.
    norm_offset: float = 0.0
    extra: Callable[[dict[str, Any], str, dict[str, Any], Callable], None] | None = None
    required: tuple[str, ...] = field(default=())  # tensors mlx-lm needs (e.g. qwen2 biases)

    def hf_name(self, gguf_name: str) -> str | None:
        """The mlx-lm parameter name of a tensor, None for tensors that are config."""
        base, _, suffix = gguf_name.rpartition(".")
        if base in _CONFIG_TENSORS or base.endswith("attn_rot_embd"):
            return None
        parts = base.split(".")
        if suffix in ("weight", "bias"):
            if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
                mapped = self.layer_names.get(parts[2])
                if mapped:
                    return f"model.layers.{parts[1]}.{mapped}.{suffix}"
            elif len(parts) == 1 and parts[0] in _GLOBAL:
                return f"{_GLOBAL[parts[0]]}.{suffix}"
        raise GGUFImportError(f"unexpected tensor {gguf_name!r} in a {self.model_type} GGUF")

    def offset_of(self, gguf_name: str) -> float:
        return self.norm_offset if gguf_name.endswith("norm.weight") else 0.0


# --------------------------------------------------------------------------------------- #
# Per-architecture config entries
# --------------------------------------------------------------------------------------- #

TensorValues = Callable[[str], "np.ndarray | None"]


def llama3_rope_scaling(rope_freqs: np.ndarray, head_dim: int, base: float) -> dict[str, Any]:
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


def _llama(md: dict[str, Any], p: str, config: dict[str, Any], tensor: TensorValues) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if int(meta(md, p + "rope.dimension_count", head_dim)) != head_dim:
        raise GGUFImportError("partial rotary embeddings are not supported for llama")
    # llama.cpp permutes Q/K rows so that rotary pairs are adjacent; reading them with the
    # interleaved ("traditional") rotary layout is equivalent to undoing the permutation,
    # and keeps quantized rows untouched.
    config["rope_traditional"] = True
    freqs = tensor("rope_freqs.weight")
    if freqs is not None and not np.allclose(freqs, 1.0):
        config["rope_scaling"] = llama3_rope_scaling(freqs, head_dim, config["rope_theta"])


def _gemma(md: dict[str, Any], p: str, config: dict[str, Any], tensor: TensorValues) -> None:
    # llama.cpp scales queries by 1/sqrt(head_dim), except for the 27B models (46 layers in
    # Gemma 2, 62 in Gemma 3) which use hidden/heads; HF calls it query_pre_attn_scalar.
    big = config["num_hidden_layers"] == (46 if p == "gemma2." else 62)
    config["query_pre_attn_scalar"] = (
        config["hidden_size"] // config["num_attention_heads"] if big else config["head_dim"]
    )
    if p == "gemma2.":
        config["attn_logit_softcapping"] = float(meta(md, p + "attn_logit_softcapping", 50.0))
        config["final_logit_softcapping"] = float(meta(md, p + "final_logit_softcapping", 30.0))
    else:  # llama.cpp hard-codes these for Gemma 3: 5 local layers per global one
        config["sliding_window"] = int(meta(md, p + "attention.sliding_window", 512))
        config["sliding_window_pattern"] = 6
        config["rope_local_base_freq"] = 10000.0


def _phi3(md: dict[str, Any], p: str, config: dict[str, Any], tensor: TensorValues) -> None:
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    config["partial_rotary_factor"] = int(meta(md, p + "rope.dimension_count", head_dim)) / head_dim
    long, short = tensor("rope_factors_long.weight"), tensor("rope_factors_short.weight")
    if long is not None and short is not None:
        config["original_max_position_embeddings"] = int(
            meta(md, p + "rope.scaling.original_context_length", 4096)
        )
        config["rope_scaling"] = {
            "type": "longrope",
            "long_factor": long.tolist(),
            "short_factor": short.tolist(),
        }


_LLAMA_NAMES = {**_ATTN_MLP, **_PRE_POST_NORMS}
ARCHS: dict[str, Arch] = {
    "llama": Arch("llama", "LlamaForCausalLM", _LLAMA_NAMES, extra=_llama),
    "qwen2": Arch(
        "qwen2",
        "Qwen2ForCausalLM",
        _LLAMA_NAMES,
        required=("blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"),
    ),
    "qwen3": Arch("qwen3", "Qwen3ForCausalLM", {**_LLAMA_NAMES, **_QK_NORMS}),
    "gemma2": Arch(
        "gemma2", "Gemma2ForCausalLM", {**_ATTN_MLP, **_GEMMA_NORMS}, norm_offset=-1.0, extra=_gemma
    ),
    "gemma3": Arch(
        "gemma3_text",
        "Gemma3ForCausalLM",
        {**_ATTN_MLP, **_GEMMA_NORMS, **_QK_NORMS},
        norm_offset=-1.0,
        extra=_gemma,
    ),
    "phi3": Arch("phi3", "Phi3ForCausalLM", _PHI3, extra=_phi3),
}


# --------------------------------------------------------------------------------------- #
# config.json
# --------------------------------------------------------------------------------------- #


def _rope_scaling(md: dict[str, Any], p: str, context: int) -> dict[str, Any] | None:
    scaling_type = meta(md, p + "rope.scaling.type", "none")
    factor = float(meta(md, p + "rope.scaling.factor", 0.0) or 0.0)
    legacy_linear = float(meta(md, p + "rope.scale_linear", 1.0))
    if scaling_type == "none" and legacy_linear != 1.0:  # pre-2024 converters
        scaling_type, factor = "linear", legacy_linear
    if scaling_type == "linear" and factor and factor != 1.0:
        return {"type": "linear", "rope_type": "linear", "factor": factor}
    if scaling_type == "yarn" and factor:
        original = int(meta(md, p + "rope.scaling.original_context_length", 0) or context)
        return {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": original,
        }
    if scaling_type not in ("none", "linear", "yarn"):
        raise GGUFImportError(f"unsupported rope scaling type {scaling_type!r}")
    return None


def build_config(
    md: dict[str, Any],
    arch_name: str,
    tensor_shapes: dict[str, tuple[int, ...]],
    tensor: TensorValues,
    vocab_size: int,
) -> dict[str, Any]:
    """config.json for ``arch_name`` from the metadata; ``tensor(name)`` reads small tables."""
    arch = ARCHS[arch_name]
    p = f"{arch_name}."
    if meta(md, p + "expert_count", 0):
        raise GGUFImportError(
            f"mixture-of-experts {arch_name} GGUF (e.g. Mixtral) is not supported"
        )
    missing = [n for n in arch.required if n not in tensor_shapes]
    if missing:
        raise GGUFImportError(f"{arch_name} GGUF lacks tensor(s) {missing}")
    hidden = int(meta(md, p + "embedding_length"))
    n_heads = int(meta(md, p + "attention.head_count"))
    head_dim = int(meta(md, p + "attention.key_length", hidden // n_heads))
    if int(meta(md, p + "attention.value_length", head_dim)) != head_dim:
        raise GGUFImportError("attention.value_length != attention.key_length is not supported")
    embd = tensor_shapes.get("token_embd.weight")
    if embd is None:
        raise GGUFImportError("GGUF file has no token_embd.weight tensor")
    if embd[0] != vocab_size:
        warnings.warn(
            f"token list has {vocab_size} entries but token_embd has {embd[0]} rows; "
            "using the embedding size",
            stacklevel=3,
        )
        vocab_size = embd[0]
    context = int(meta(md, p + "context_length"))
    config: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(meta(md, p + "block_count")),
        "intermediate_size": int(meta(md, p + "feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta(md, p + "attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta(md, p + "attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": context,
        "rope_theta": float(meta(md, p + "rope.freq_base", 10000.0)),
        "rope_traditional": False,
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "attention_bias": "blk.0.attn_q.bias" in tensor_shapes,
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_shapes,
    }
    scaling = _rope_scaling(md, p, context)
    if scaling is not None:
        config["rope_scaling"] = scaling
    if arch.extra is not None:
        arch.extra(md, p, config, tensor)
    return config
