"""Which engine serves which kind of model. Runs on the device worker thread."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

from mlxd.config import Settings
from mlxd.core.errors import ModelLoadError
from mlxd.engines.options import TextEngineOptions, VisionEngineOptions


def loads_off_device(kind: str) -> bool:
    """Whether :func:`create_engine` may run on a loader thread for this kind (then
    :func:`finish_on_device` completes the engine on the device thread): reading and
    evaluating weights off the device thread keeps other models decoding during a load."""
    return kind == "chat"


def finish_on_device(engine: Any, settings: Settings) -> Future:
    """The device-thread part of a load: the batch on the device stream, then the warm-up
    started as the engine's own work (attach the engine so the worker steps it); the Future
    completes when the warm-up has."""
    engine.bind()
    if settings.engine.warmup:
        return engine.start_warmup()
    done: Future = Future()
    done.set_result(None)
    return done


def create_engine(
    kind: str,
    name: str,
    path: Path,
    settings: Settings,
    *,
    draft_path: Path | None = None,
    max_num_seqs: int | None = None,
) -> Any:
    """Load ``path`` as a ``kind`` model. Chat engines come back unbound and cold (see
    :func:`finish_on_device`); every other kind comes back warmed up, built on the device
    thread, which then owns it. ``draft_path``: the draft model (engine.speculative: draft);
    ``max_num_seqs``: the batch size the model manager resolved (core/slots.py)."""
    if kind == "chat":
        from mlxd.engines.llm import LLMEngine

        return LLMEngine(
            name,
            path,
            TextEngineOptions.from_settings(
                settings, name, draft_path=draft_path, max_num_seqs=max_num_seqs
            ),
        )
    if kind in ("embedding", "reranker"):
        return _create_encoder(kind, name, path, settings)
    if kind == "vision":
        return _create_vision(name, path, settings, max_num_seqs)
    if kind in ("stt", "tts"):
        return _create_audio(kind, name, path, settings)
    raise ModelLoadError(
        f"model '{name}' is a {kind} model; this server does not serve {kind} models yet"
    )


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
                name,
                path,
                llm_batch_policy(settings),
                dtype=dtype,
                trust_remote_code=getattr(settings.models, "trust_remote_code", False),
            )
        else:
            engine = CrossEncoderEngine(name, path, policy, dtype=dtype)
    if settings.engine.warmup:
        engine.warmup()
    return engine


def _create_audio(kind: str, name: str, path: Path, settings: Settings) -> Any:
    """Speech to text (Whisper windows, batched like encoder inputs) and text to speech."""
    from mlxd.engines.batching import BatchPolicy

    a = settings.audio
    policy = BatchPolicy(
        max_batch_size=a.max_batch_size,
        max_batch_tokens=a.max_batch_size,
        max_wait_s=a.max_wait_ms / 1000.0,
        pass_overhead_tokens=a.max_batch_size,
    )  # one pass per batch
    engine: Any
    if kind == "stt":
        from mlxd.engines.stt import SpeechToTextEngine

        engine = SpeechToTextEngine(
            name, path, policy, max_tokens=a.max_tokens_per_window, dtype=settings.models.dtype
        )
    else:
        from mlxd.engines.tts import TextToSpeechEngine
        from mlxd.store.inspect import read_config, tts_architecture

        arch = tts_architecture(
            str(read_config(path).get("model_type") or ""), f"{name} {Path(path).name}"
        )
        engine = TextToSpeechEngine(
            name, path, policy, max_tokens=a.tts_max_tokens, architecture=arch
        )
    if settings.engine.warmup:
        engine.warmup()
    return engine


def _create_vision(name: str, path: Path, settings: Settings, max_num_seqs: int | None) -> Any:
    from mlxd.engines.vlm import VisionEngine

    engine = VisionEngine(
        name, path, VisionEngineOptions.from_settings(settings, name, max_num_seqs=max_num_seqs)
    )
    if settings.engine.warmup:
        engine.warmup()
    return engine
