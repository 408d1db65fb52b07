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
        )
        if e.warmup:
            engine.warmup()
        return engine
    raise ModelLoadError(f"model '{name}' is a {kind} model; this server does not serve "
                         f"{kind} models yet")
