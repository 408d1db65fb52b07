"""Which engine serves which kind of model. Runs on the device worker thread."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any

from mlxd.config import Settings, resolve_kv_quant_scheme
from mlxd.core.devices import core_folder_tag
from mlxd.core.errors import ModelLoadError


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


def create_engine(kind: str, name: str, path: Path, settings: Settings, *,
                  draft_path: Path | None = None, max_num_seqs: int | None = None) -> Any:
    """Load ``path`` as a ``kind`` model. Chat engines come back unbound and cold (see
    :func:`finish_on_device`); every other kind comes back warmed up, built on the device
    thread, which then owns it. ``draft_path``: the draft model (engine.speculative: draft);
    ``max_num_seqs``: the batch size the model manager resolved (core/slots.py)."""
    if max_num_seqs is None:  # a caller that did not resolve it: a set number, or the floor
        max_num_seqs = _fixed_max_num_seqs(name, settings)
    if kind == "chat":
        from mlxd.engines.llm import LLMEngine

        e = settings.engine
        opts = _model_options(name, settings)
        if opts["kv_bits"] is not None:
            # mlx-lm 0.32's BatchGenerator merges per-sequence caches into a batch through
            # each cache class's ``merge``; QuantizedKVCache has none (and there is no
            # batched quantized cache in mlx-lm), so a quantized KV cache cannot join a batch.
            raise ModelLoadError(
                f"{_option_key(name, settings, 'kv_bits')} is set, but '{name}' is a text "
                "model: mlx-lm's BatchGenerator cannot batch a quantized KV cache, so text "
                "models do not take kv_bits (max_kv_size bounds their KV cache instead). "
                "Set kv_bits per vision model under models.options.<name>.kv_bits.")
        engine = LLMEngine(
            name,
            path,
            max_num_seqs=max_num_seqs,
            prefill_batch_size=e.prefill_batch_size,
            prefill_step_size=opts["prefill_step_size"],
            max_step_tokens=e.max_step_tokens,
            dtype=settings.models.dtype,
            trust_remote_code=settings.models.trust_remote_code,
            prefix_cache_bytes=e.prefix_cache_bytes,
            prefix_cache_min_tokens=e.prefix_cache_min_tokens,
            prefix_cache_disk_bytes=e.prefix_cache_disk_bytes,
            prefix_cache_disk_min_tokens=e.prefix_cache_disk_min_tokens,
            prefix_cache_disk_writes=e.prefix_cache_disk_writes,
            prefix_cache_dir=(e.prefix_cache_dir or settings.home / "prefix-cache")
            / core_folder_tag(),  # one folder per engine core when there are several
            adapter_path=opts["adapter_path"],
            max_kv_size=opts["max_kv_size"],
            speculative=e.speculative,
            draft_path=draft_path,
            num_draft_tokens=e.num_draft_tokens,
            speculative_max_batch=e.speculative_max_batch,
            speculative_min_acceptance=e.speculative_min_acceptance,
        )
        return engine
    if kind in ("embedding", "reranker"):
        return _create_encoder(kind, name, path, settings)
    if kind == "vision":
        return _create_vision(name, path, settings, max_num_seqs)
    if kind in ("stt", "tts"):
        return _create_audio(kind, name, path, settings)
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


def _create_audio(kind: str, name: str, path: Path, settings: Settings) -> Any:
    """Speech to text (Whisper windows, batched like encoder inputs) and text to speech."""
    from mlxd.engines.batching import BatchPolicy

    a = settings.audio
    policy = BatchPolicy(max_batch_size=a.max_batch_size, max_batch_tokens=a.max_batch_size,
                         max_wait_s=a.max_wait_ms / 1000.0,
                         pass_overhead_tokens=a.max_batch_size)  # one pass per batch
    engine: Any
    if kind == "stt":
        from mlxd.engines.stt import SpeechToTextEngine

        engine = SpeechToTextEngine(name, path, policy, max_tokens=a.max_tokens_per_window,
                                    dtype=settings.models.dtype)
    else:
        from mlxd.engines.tts import TextToSpeechEngine
        from mlxd.store.inspect import read_config, tts_architecture

        arch = tts_architecture(str(read_config(path).get("model_type") or ""),
                                f"{name} {Path(path).name}")
        engine = TextToSpeechEngine(name, path, policy, max_tokens=a.tts_max_tokens,
                                    architecture=arch)
    if settings.engine.warmup:
        engine.warmup()
    return engine


def _model_options(name: str, settings: Settings) -> dict[str, Any]:
    """The engine's KV options and adapter for ``name``: models.options.<name> over engine.*;
    models.adapter_path belongs to the default model."""
    e, m = settings.engine, settings.models
    out: dict[str, Any] = {"kv_bits": e.kv_bits, "kv_quant_scheme": e.kv_quant_scheme,
                           "kv_group_size": e.kv_group_size, "max_kv_size": e.max_kv_size,
                           "prefill_step_size": e.prefill_step_size, "adapter_path": None}
    default = Path(m.default).expanduser()
    default_name = default.resolve().name if (
        ("/" in m.default or m.default.startswith(".")) and default.is_dir()) else m.default
    if name == default_name and m.adapter_path is not None:
        out["adapter_path"] = m.adapter_path
    opts = m.options.get(name)
    if opts is not None:  # the batch size is the model manager's (core/slots.py)
        out.update({k: v for k, v in opts.model_dump(exclude={"max_num_seqs"}).items()
                    if v is not None})
    out["kv_quant_scheme"] = resolve_kv_quant_scheme(out["kv_bits"], out["kv_quant_scheme"])
    return out


def _fixed_max_num_seqs(name: str, settings: Settings) -> int:
    """The batch size without a memory budget to size it by: a set number as it is, and
    for 'auto' the floor that auto never goes below."""
    opts = settings.models.options.get(name)
    value = opts.max_num_seqs if opts is not None and opts.max_num_seqs is not None \
        else settings.engine.max_num_seqs
    return value if isinstance(value, int) else 8  # core/slots.py's AUTO_FLOOR


def _option_key(name: str, settings: Settings, key: str) -> str:
    """Where the operator set ``key`` for ``name``: its models.options entry, else engine."""
    opts = settings.models.options.get(name)
    if opts is not None and getattr(opts, key, None) is not None:
        return f"models.options.{name}.{key}"
    return f"engine.{key}"


def _create_vision(name: str, path: Path, settings: Settings, max_num_seqs: int) -> Any:
    from mlxd.engines.vlm import VisionEngine

    e, v = settings.engine, settings.vision
    engine = VisionEngine(
        name, path, max_num_seqs=max_num_seqs, prefill_batch_size=e.prefill_batch_size,
        dtype=settings.models.dtype, trust_remote_code=settings.models.trust_remote_code,
        batching=v.batching, feature_cache_entries=v.feature_cache_entries,
        feature_cache_bytes=v.feature_cache_bytes, **_model_options(name, settings),
    )
    if e.warmup:
        engine.warmup()
    return engine
