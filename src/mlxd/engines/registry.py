"""Which engine serves which kind of model. Runs on the device worker thread."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxd.config import Settings
from mlxd.core.errors import ModelLoadError


def create_engine(kind: str, name: str, path: Path, settings: Settings) -> Any:
    """Load ``path`` as a ``kind`` model and warm it up; the worker owns the result."""
    if kind == "chat":
        from mlxd.engines.llm import LLMEngine

        e = settings.engine
        engine = LLMEngine(
            name,
            path,
            max_num_seqs=e.max_num_seqs,
            prefill_batch_size=e.prefill_batch_size,
            prefill_step_size=e.prefill_step_size,
            dtype=settings.models.dtype,
            trust_remote_code=settings.models.trust_remote_code,
        )
        if e.warmup:
            engine.warmup()
        return engine
    if kind in ("embedding", "reranker"):
        return _create_encoder(kind, name, path, settings)
    raise ModelLoadError(f"model '{name}' is a {kind} model; this server does not serve "
                         f"{kind} models yet")


def _create_encoder(kind: str, name: str, path: Path, settings: Settings) -> Any:
    """Embedding models and rerankers (cross-encoders, or causal LMs scored yes/no)."""
    from mlxd.engines.encoder import batch_policy, llm_batch_policy, read_json

    policy = batch_policy(settings)
    dtype = settings.models.dtype
    if kind == "embedding":
        from mlxd.engines.embed import EmbeddingEngine

        engine: Any = EmbeddingEngine(name, path, policy, dtype=dtype)
    else:
        from mlxd.engines.rerank import CrossEncoderEngine, LLMRerankEngine, is_causal_lm

        if is_causal_lm(read_json(Path(path) / "config.json")):
            engine = LLMRerankEngine.load(
                name, path, llm_batch_policy(settings), dtype=dtype,
                trust_remote_code=getattr(settings.models, "trust_remote_code", False))
        else:
            engine = CrossEncoderEngine(name, path, policy, dtype=dtype)
    if settings.engine.warmup:
        engine.warmup()
    return engine
