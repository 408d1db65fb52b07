"""The engine core's request/response calls: model management, status and encoders.

Each is a coroutine ``fn(core, request) -> result``, the request and result being the call's
structs in enginecore/protocol.py (bytes for vectors and audio); :data:`HANDLERS` maps the
request's type to it. Errors travel back as :class:`~.protocol.WireError`.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from mlxd.core.devices import DEVICE_ENV
from mlxd.core.errors import InvalidRequest, ModelNotFound
from mlxd.core.types import EmbedRequest, RerankRequest
from mlxd.enginecore import group
from mlxd.enginecore import protocol as p
from mlxd.text.processor import tokenizer_defaults


def model_info(entry: Any) -> p.ModelInfo:
    """What a front end needs to serve a loaded model: its tokenizer's place and limits."""
    engine = entry.engine
    return p.ModelInfo(
        name=entry.name,
        kind=entry.kind,
        path=str(entry.path),
        context_length=int(getattr(engine, "context_length", 0) or 0),
        vocab_size=int(getattr(engine, "vocab_size", 0) or 0),
        eos_token_ids=list(getattr(engine, "eos_token_ids", []) or []),
        adapter_path=str(engine.adapter_path) if getattr(engine, "adapter_path", None) else None,
        sample_rate=int(getattr(engine, "sample_rate", 0) or 0),
        window_seconds=int(getattr(engine, "window_seconds", 0) or 0),
        tokenizer_defaults=tokenizer_defaults(getattr(engine, "model", None)),
    )


def loaded_view(entry: Any) -> dict[str, Any]:
    """One loaded model for /health, /api/ps and /v1/models."""
    engine = entry.engine
    view = {
        "name": entry.name,
        "kind": entry.kind,
        "path": str(entry.path),
        "size": entry.size,
        "pinned": entry.pinned,
        "active_requests": entry.active,
        "expires_at": None if entry.expires_at == float("inf") else entry.expires_at,
        "loaded_at": entry.loaded_at,
        "load_seconds": entry.load_seconds,
        "running": engine.num_running,
        "waiting": engine.num_waiting,
        "max_batch_size_seen": engine.max_batch_seen,
        "context_length": engine.context_length,
    }
    if entry.max_num_seqs is not None:  # chat and vision models (core/slots.py)
        view["max_num_seqs"] = entry.max_num_seqs
        view["max_num_seqs_reason"] = entry.max_num_seqs_reason
    view.update(engine.stats())
    view["cache_memory_bytes"] = engine.memory_bytes()
    adapter = getattr(engine, "adapter_path", None)
    view["adapter_path"] = str(adapter) if adapter else None
    kv_options = getattr(engine, "kv_options", None)  # decode engines; encoders have none
    if kv_options is not None:
        view["options"] = kv_options()
    return view


def memory() -> dict[str, int]:
    """MLX's allocator view: what arrays hold, what its cache keeps, and the peak."""
    try:
        import mlx.core as mx

        return {
            "active_bytes": mx.get_active_memory(),
            "cache_bytes": mx.get_cache_memory(),
            "peak_bytes": mx.get_peak_memory(),
        }
    except Exception:  # noqa: BLE001 - a backend without these counters
        return {}


async def touch(core: Any, req: p.Touch) -> p.ModelInfo:
    entry = await core.models.touch(req.model, req.keep_alive)
    return model_info(entry)


async def unload(core: Any, req: p.Unload) -> p.Unloaded:
    result = await core.models.unload(req.model)
    return p.Unloaded(result["unloaded"], result["deferred"], memory())


async def load_lora(core: Any, req: p.LoadLora) -> p.Done:
    entry = await core.models.touch(req.model, None)
    engine = entry.engine
    if not hasattr(engine, "load_adapter"):
        raise InvalidRequest(
            f"model '{entry.name}' takes no LoRA adapters per request (a {engine.kind} model)",
            param="base_model",
        )
    await asyncio.wrap_future(
        core.models.worker.call(lambda: engine.load_adapter(req.name, req.path))
    )
    return p.Done()


async def unload_lora(core: Any, req: p.UnloadLora) -> p.Done:
    for entry in core.models.loaded():
        engine = entry.engine
        if hasattr(engine, "unload_adapter"):
            await asyncio.wrap_future(
                core.models.worker.call(lambda e=engine: e.unload_adapter(req.name))
            )
    return p.Done()


async def loaded(core: Any, req: p.Loaded) -> p.LoadedModels:
    return p.LoadedModels([loaded_view(e) for e in core.models.loaded()])


async def forget(core: Any, req: p.Forget) -> p.Done:
    core.models.forget_store_entry(req.name)
    return p.Done()


async def status(core: Any, req: p.Status) -> p.CoreStatus:
    from mlxd import blas
    from mlxd.engines.backend import backend_name

    m = core.models
    loaded_blas = blas.current()
    # one reading of each model's caches serves both totals: the device thread reshapes its
    # batches between two readings, and /health's sum must be the sum of its parts
    views = [loaded_view(e) for e in m.loaded()]
    caches = sum(sum(v["cache_memory_bytes"].values()) for v in views)
    return p.CoreStatus(
        pid=os.getpid(),
        epoch=core.epoch,
        backend=backend_name(),
        blas=loaded_blas.describe() if loaded_blas is not None else "MLX's bundled BLAS",
        device=os.environ.get(DEVICE_ENV) or "default",
        uptime_s=round(time.time() - core.started_at, 3),
        requests_in_flight=core._inflight,
        requests_total=core.admitted_total,
        memory={
            **memory(),
            "budget_bytes": m.budget,
            "models_bytes": m.used_bytes,
            "caches_bytes": caches,
        },
        model_loads=dict(m.load_counts),
        model_evictions=m.evictions,
        models=views,
        rank_group=group.status(),
    )


async def metrics_text(core: Any, req: p.Metrics) -> p.MetricsText:
    from prometheus_client import generate_latest

    from mlxd.observability.metrics import REGISTRY

    return p.MetricsText(generate_latest(REGISTRY))


async def embed(core: Any, req: p.Embed) -> p.Embedded:
    res = await core.encoders.embed(
        EmbedRequest(
            req.model,
            req.inputs,
            truncate=req.truncate,
            dimensions=req.dimensions,
            keep_alive=req.keep_alive,
            request_id=req.request_id,
        )
    )
    vec = np.ascontiguousarray(res.vectors, dtype=np.float32)
    return p.Embedded(
        res.model,
        vec.tobytes(),
        list(vec.shape),
        res.prompt_tokens,
        max(res.timings.t_acquired - res.timings.t_submitted, 0.0),
    )


async def rerank(core: Any, req: p.Rerank) -> p.Reranked:
    res = await core.encoders.rerank(
        RerankRequest(
            req.model,
            req.query,
            req.documents,
            truncate=req.truncate,
            instruction=req.instruction,
            keep_alive=req.keep_alive,
            request_id=req.request_id,
        )
    )
    return p.Reranked(
        res.model,
        [float(s) for s in res.scores],
        res.prompt_tokens,
        max(res.timings.t_acquired - res.timings.t_submitted, 0.0),
    )


async def transcribe(core: Any, req: p.Transcribe) -> p.Transcribed:
    """One window of samples (16 kHz mono float32 bytes, at most 30 s) to text and
    segments."""
    res = await core.audio.transcribe(
        req.model,
        req.audio,
        task=req.task,
        language=req.language,
        prompt=req.prompt,
        temperature=req.temperature,
        words=req.words,
        keep_alive=req.keep_alive,
    )
    return p.Transcribed(res["model"], res["duration"], p.TranscriptWindow(**res["window"]))


async def speak(core: Any, req: p.Speak) -> p.Spoken:
    """Text to audio (float32 bytes at the model's sample rate)."""
    res = await core.audio.speak(
        req.model, req.text, voice=req.voice, speed=req.speed, keep_alive=req.keep_alive
    )
    return p.Spoken(res["model"], res["audio"], int(res["sample_rate"]), bool(res["speed_applied"]))


async def tokenize(core: Any, req: p.Tokenize) -> p.Tokenized:
    res = await core.encoders.tokenize(
        req.model,
        req.inputs,
        req.messages,
        add_special_tokens=req.add_special_tokens,
        token_strings=req.token_strings,
        keep_alive=req.keep_alive,
    )
    return p.Tokenized(res.model, res.kind, res.tokens, res.context_length, res.token_strings)


async def scorers(core: Any, req: p.Scorers) -> p.ScorerCount:
    """How many LLM rerank scorers borrow a chat model's weights (tests)."""
    return p.ScorerCount(len(core.encoders.scorers()))


async def fault(core: Any, req: p.Fault) -> p.Faulted:
    """Failure drills (only with MLXD_TEST_FAULTS=1): how a core dies or fails in the field.

    ``kill``/``abort``: the process dies (SIGKILL; SIGABRT as a Metal/CUDA abort does);
    ``worker``: the device thread dies; ``step_error``: ``model``'s next step raises
    RuntimeError(``message``); ``slow_steps``: each step of ``model`` sleeps ``seconds``
    first (0 ends it and wakes a step asleep); ``load_error``: the next load raises
    MemoryError(``message``); ``hold_load``: the next load waits before reading its weights
    until ``release_load`` (``held_loads``: how many wait now), so that tests order events
    around a load without timing it; ``scorer_plain_head``: LLM rerank scorers take their
    LM-head shortcut or not (``value``: the path of architectures without a plain head).
    """
    import signal

    kind, model, message = req.kind, req.model, req.message
    if kind == "hold_load":
        _LOAD_GATE.hold()
        return p.Faulted()
    if kind == "held_loads":
        return p.Faulted(held_loads=_LOAD_GATE.waiting)
    if kind == "release_load":
        _LOAD_GATE.release()
        return p.Faulted()
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "abort":
        os.abort()
    elif kind == "worker":
        core.worker.inject_fault(RuntimeError(message or "simulated device thread crash"))
    elif kind in ("step_error", "slow_steps"):
        entry = core.models.get_loaded(model or core.models.default_name)
        if entry is None:
            raise ModelNotFound(f"model '{model}' is not loaded")
        _patch_step(entry.engine, kind, req.seconds, message)
    elif kind == "load_error":
        import mlxd.engines.registry as registry

        real = registry.create_engine

        def failing(*args: Any, **kw: Any) -> Any:
            registry.create_engine = real
            raise MemoryError(message or "simulated: cannot allocate the weights")

        registry.create_engine = failing
    elif kind == "scorer_plain_head":
        for scorer in core.encoders.scorers():
            scorer._plain_head = req.value
    else:
        raise ModelNotFound(f"unknown fault '{kind}'")
    return p.Faulted()


class _LoadGate:
    """``hold_load``'s gate: the next ``create_engine`` call waits at it until released."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: threading.Event | None = None
        self.waiting = 0

    def hold(self) -> None:
        import mlxd.engines.registry as registry

        with self._lock:
            if self._open is not None:
                return
            self._open = opened = threading.Event()
        real = registry.create_engine

        def held(*args: Any, **kw: Any) -> Any:
            registry.create_engine = real
            with self._lock:
                self.waiting += 1
            try:
                opened.wait()
            finally:
                with self._lock:
                    self.waiting -= 1
            return real(*args, **kw)

        registry.create_engine = held

    def release(self) -> None:
        with self._lock:
            opened, self._open = self._open, None
        if opened is not None:
            opened.set()


_LOAD_GATE = _LoadGate()


def _patch_step(engine: Any, kind: str, seconds: float, message: str) -> None:
    real = type(engine).step
    woken = engine.__dict__.pop("_slow_steps_end", None)
    if woken is not None:  # a step asleep under the previous setting wakes now
        woken.set()

    if kind == "step_error":

        def step() -> Any:
            del engine.step  # once
            raise RuntimeError(message)
    elif seconds > 0:
        end = engine._slow_steps_end = threading.Event()

        def step() -> Any:
            end.wait(seconds)
            return real(engine)
    else:
        engine.__dict__.pop("step", None)
        return
    engine.step = step


# Each call's handler, by its request's type (every member of protocol.CallRequest).
HANDLERS: dict[type[p.Request], Callable[[Any, Any], Awaitable[p.CallResult]]] = {
    p.LoadLora: load_lora,
    p.UnloadLora: unload_lora,
    p.Touch: touch,
    p.Unload: unload,
    p.Loaded: loaded,
    p.Forget: forget,
    p.Status: status,
    p.Metrics: metrics_text,
    p.Embed: embed,
    p.Rerank: rerank,
    p.Tokenize: tokenize,
    p.Transcribe: transcribe,
    p.Speak: speak,
    p.Scorers: scorers,
    p.Fault: fault,
}
