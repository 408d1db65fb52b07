"""What a model directory holds, read from its files alone (no MLX, no network).

``infer_kind`` tells chat / vision / embedding / reranker from ``config.json`` and the
sentence-transformers files; ``summarize`` gives architecture, parameter count, context
length, quantization and dtype for manifests, ``mlxd show`` and ``mlxd list``.
"""

from __future__ import annotations

import importlib.util
import json
import re
import struct
from pathlib import Path
from typing import Any

# Architectures (config.json "architectures") and model types that take images.
_VISION_ARCHS = frozenset(
    {
        "LlavaForConditionalGeneration",
        "LlavaNextForConditionalGeneration",
        "LlavaOnevisionForConditionalGeneration",
        "LlavaQwenForCausalLM",
        "Qwen2VLForConditionalGeneration",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration",
        "Gemma3ForConditionalGeneration",
        "Gemma3nForConditionalGeneration",
        "PaliGemmaForConditionalGeneration",
        "Idefics2ForConditionalGeneration",
        "Idefics3ForConditionalGeneration",
        "SmolVLMForConditionalGeneration",
        "MllamaForConditionalGeneration",
        "Mistral3ForConditionalGeneration",
        "PixtralForConditionalGeneration",
        "Florence2ForConditionalGeneration",
        "Phi3VForCausalLM",
        "Phi4MMForCausalLM",
        "InternVLChatModel",
        "MiniCPMV",
        "AyaVisionForConditionalGeneration",
        "Glm4vForConditionalGeneration",
        "KimiVLForConditionalGeneration",
        "DeepseekVLV2ForCausalLM",
        "MolmoForCausalLM",
    }
)
_VISION_TYPES = frozenset(
    {
        "llava",
        "llava_next",
        "llava-qwen2",
        "llava_onevision",
        "qwen2_vl",
        "qwen2_5_vl",
        "qwen3_vl",
        "qwen3_vl_moe",
        "gemma3",
        "gemma3n",
        "paligemma",
        "idefics2",
        "idefics3",
        "smolvlm",
        "mllama",
        "mistral3",
        "pixtral",
        "florence2",
        "phi3_v",
        "internvl_chat",
        "minicpmv",
        "aya_vision",
        "glm4v",
        "kimi_vl",
        "deepseek_vl_v2",
        "molmo",
    }
)
# Encoders whose bare model (no task head) is an embedding model.
_ENCODER_TYPES = frozenset(
    {
        "bert",
        "roberta",
        "xlm-roberta",
        "distilbert",
        "mpnet",
        "nomic_bert",
        "modernbert",
        "electra",
        "deberta",
        "deberta-v2",
        "camembert",
        "new",
        "gte",
        "jina_bert",
        "e5",
    }
)
# Text-to-speech architectures mlx-audio serves, as its checkpoints name them (config
# model_type, or a part of the repository name where the config says only "qwen3"/"llama").
TTS_ARCHS = (
    "soprano",
    "kokoro",
    "kitten",
    "outetts",
    "spark",
    "sesame",
    "csm",
    "marvis",
    "orpheus",
    "dia",
    "bark",
    "qwen3_tts",
    "pocket_tts",
    "vibevoice",
    "voxcpm",
    "chatterbox",
    "melotts",
    "indextts",
    "voxtral_tts",
    "echo_tts",
    "omnivoice",
)
_SENTENCE_TRANSFORMERS_FILES = (
    "modules.json",
    "config_sentence_transformers.json",
    "sentence_bert_config.json",
)


def read_config(model_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def infer_kind(model_dir: Path, *, hint: str | None = None) -> str | None:
    """chat / vision / embedding / reranker / stt / tts, or None when the files do not say.

    ``hint`` is the name the model came by (hub id, file name); without it the directory
    name is used. Names only decide between kinds the architecture leaves open (a
    Qwen3-Embedding or Qwen3-Reranker is a ``*ForCausalLM`` on paper).
    """
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    archs = [a for a in cfg.get("architectures") or [] if isinstance(a, str)]
    model_type = str(cfg.get("model_type") or "")
    names = " ".join(
        str(x)
        for x in (hint if hint is not None else model_dir.name, cfg.get("_name_or_path") or "")
        if x
    ).lower()
    has_st = any((model_dir / f).is_file() for f in _SENTENCE_TRANSFORMERS_FILES)

    if model_type == "whisper" or "WhisperForConditionalGeneration" in archs:
        return "stt"
    if tts_architecture(model_type, names):
        return "tts"
    if any(a.endswith("ForSequenceClassification") for a in archs):
        labels = cfg.get("id2label") or {}
        single = cfg.get("num_labels", len(labels) or 1) == 1 or len(labels) == 1
        if single or "rerank" in names or "cross-encoder" in names:
            return "reranker"
        return None  # a classifier (sentiment, NLI...): not something we serve
    if "rerank" in names:
        return "reranker"
    if has_st or "embedding" in names or "-embed-" in names:
        return "embedding"
    if (
        ("vision_config" in cfg and isinstance(cfg["vision_config"], dict))
        or model_type in _VISION_TYPES
        or any(a in _VISION_ARCHS for a in archs)
    ):
        # mlx-community text-only conversions of multimodal models drop vision_config
        if (
            model_type in ("gemma3", "mistral3", "qwen2_vl", "qwen2_5_vl")
            and "vision_config" not in cfg
        ):
            return "chat"
        return "vision"
    if any(a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) for a in archs):
        return "chat"
    if any(a.endswith("Model") for a in archs):
        return "embedding"  # a bare base model (BertModel, XLMRobertaModel, Qwen3Model...)
    if not archs:
        if model_type in _ENCODER_TYPES:
            return "embedding"
        if model_type and _mlx_lm_has(model_type):
            return "chat"
    return None


def tts_architecture(model_type: str, names: str) -> str | None:
    """The mlx-audio TTS architecture a checkpoint is, from its model_type or its names."""
    if model_type in TTS_ARCHS:
        return model_type
    parts = set(re.split(r"[^a-z0-9_]+", names.lower()))
    return next((a for a in TTS_ARCHS if a in parts), None)


def _mlx_lm_has(model_type: str) -> bool:
    """Whether mlx-lm ships an implementation for ``model_type`` (without importing it)."""
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return False
    base = Path(next(iter(spec.submodule_search_locations))) / "models"
    return (base / f"{model_type.replace('-', '_')}.py").is_file()


def context_length(cfg: dict[str, Any]) -> int | None:
    for c in (cfg, cfg.get("text_config") or {}):
        for key in (
            "max_position_embeddings",
            "n_positions",
            "max_seq_len",
            "seq_length",
            "max_sequence_length",
            "n_ctx",
        ):
            v = c.get(key)
            if isinstance(v, int) and v > 0:
                return v
    return None


def quantization(cfg: dict[str, Any]) -> dict[str, Any] | None:
    q = cfg.get("quantization") or cfg.get("quantization_config")
    if not isinstance(q, dict) or "bits" not in q:
        return None
    out = {"bits": q["bits"], "group_size": q.get("group_size")}
    if q.get("mode") and q.get("mode") != "affine":
        out["mode"] = q["mode"]
    return out


def safetensors_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        if n > 100 << 20:
            raise ValueError(f"{path}: implausible safetensors header")
        return json.loads(fh.read(n))


def count_parameters(model_dir: Path, cfg: dict[str, Any] | None = None) -> int | None:
    """Parameters from the weight index (mlx-lm writes the total) or the tensor headers;
    packed quantized weights count as the matrices they stand for."""
    model_dir = Path(model_dir)
    cfg = read_config(model_dir) if cfg is None else cfg
    try:
        index = json.loads((model_dir / "model.safetensors.index.json").read_text())
        total = (index.get("metadata") or {}).get("total_parameters")
        if isinstance(total, int) and total > 0:
            return total
    except (OSError, ValueError):
        pass
    quant = cfg.get("quantization")
    q: dict[str, Any] = quant if isinstance(quant, dict) else {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    try:
        for f in files:
            header = safetensors_header(f)
            keys = set(header)
            for key, meta in header.items():
                if key == "__metadata__" or not isinstance(meta, dict):
                    continue
                if (
                    key.endswith((".scales", ".biases"))
                    and key.rsplit(".", 1)[0] + ".weight" in keys
                ):
                    continue
                shape = meta.get("shape") or []
                n = 1
                for s in shape:
                    n *= int(s)
                module = key.rsplit(".", 1)[0]
                if meta.get("dtype") == "U32" and module + ".scales" in keys and shape:
                    own = q.get(module)
                    layer: dict[str, Any] = own if isinstance(own, dict) else q
                    bits = int(layer.get("bits") or q.get("bits") or 4)
                    n = n * 32 // bits
                total += n
    except (OSError, ValueError, struct.error):
        return None
    return total or None


def summarize(model_dir: Path) -> dict[str, Any]:
    """The facts ``show``/``list`` print and the manifest keeps."""
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    archs = cfg.get("architectures") or []
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    return {
        "architecture": archs[0] if archs and isinstance(archs[0], str) else None,
        "model_type": cfg.get("model_type"),
        "num_parameters": count_parameters(model_dir, cfg),
        "context_length": context_length(cfg),
        "quantization": quantization(cfg),
        "dtype": dtype if isinstance(dtype, str) else None,
        "hidden_size": cfg.get("hidden_size") or (cfg.get("text_config") or {}).get("hidden_size"),
        "vocab_size": cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size"),
    }


def human_size(n: int | float | None) -> str:
    """Bytes in decimal units, as Ollama prints them ("91 MB", "4.7 GB")."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit in ("B", "KB", "MB") or n >= 100 else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def human_count(n: int | None) -> str:
    """A parameter count: 135M, 1.2B."""
    if not n:
        return "-"
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            v = n / div
            return f"{v:.1f}{unit}" if v < 10 else f"{v:.0f}{unit}"
    return str(n)


def quant_label(manifest: dict[str, Any]) -> str:
    """ "4-bit", "8-bit (g32)", or the dtype when the weights are not quantized."""
    q = manifest.get("quantization")
    if isinstance(q, dict) and q.get("bits"):
        label = f"{q['bits']}-bit"
        if q.get("mode"):
            label += f" {q['mode']}"
        return label
    dtype = str(manifest.get("dtype") or "-")
    return {"native": "gguf-native", "float32": "F32", "float16": "F16", "bfloat16": "BF16"}.get(
        dtype, dtype
    )
