"""The runtime facade the API dialects call: admission, validation, streaming of events."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from mlxd.config import Settings
from mlxd.core.errors import (
    ContextLengthExceeded,
    EngineError,
    InvalidRequest,
    MlxdError,
    ModelNotFound,
    OutOfMemory,
    QueueFull,
    Unavailable,
)
from mlxd.core.types import GenerateRequest, TokenEvent
from mlxd.observability.context import note
from mlxd.observability.metrics import GenerationObserver
from mlxd.runtime.encoders import EncoderService
from mlxd.runtime.models import ModelManager
from mlxd.runtime.worker import DeviceWorker, WorkerDied, WorkerSupervisor, is_out_of_memory

log = logging.getLogger(__name__)


class Runtime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.worker = DeviceWorker()
        self.models = ModelManager(settings, self.worker)
        self.started_at = time.time()
        self._inflight = 0
        self.draining = False  # set on SIGTERM: admit nothing new, finish what runs
        self.supervisor = WorkerSupervisor(self.worker, self._reload_after_restart)
        self.encoders = EncoderService(self)  # embeddings, reranking, token counts

    async def start(self) -> None:
        self.models.store.clean_temp()
        self.worker.start()
        for name in dict.fromkeys([self.models.default_name, *self.models.preload_names]):
            await self.models.touch(name, None)
        self._sweeper = asyncio.create_task(self._sweep())
        self.supervisor.start()

    async def _reload_after_restart(self) -> None:
        """A fresh device worker: forget the dead one's engines, load the pinned models."""
        self.models.reset_after_worker_restart()
        for name in dict.fromkeys([self.models.default_name, *self.models.preload_names]):
            try:
                await self.models.touch(name, None)
            except Exception:  # noqa: BLE001 - it loads again on first use
                log.exception("could not reload %s after the worker restart", name)

    async def stop(self) -> None:
        self.supervisor.stop()
        sweeper = getattr(self, "_sweeper", None)
        if sweeper is not None:
            sweeper.cancel()
        await self.models.unload_all()
        self.worker.stop()

    async def _sweep(self, every: float = 0.5) -> None:
        """Unload models whose keep_alive ran out."""
        while True:
            await asyncio.sleep(every)
            try:
                self.models.expire()
            except Exception:  # noqa: BLE001 - the sweeper must outlive any one failure
                log.exception("model expiry sweep failed")

    # -- status ----------------------------------------------------------------------------
    @property
    def backend(self) -> str:
        """'cpu', 'metal' or 'cuda'."""
        from mlxd.engines.backend import backend_name

        return backend_name()

    @property
    def healthy(self) -> bool:
        """Able to serve: the worker runs, is not mid-restart (models reloading), no drain."""
        return self.worker.alive and not self.supervisor.restarting and not self.draining

    @property
    def admission_limit(self) -> int:
        e = self.settings.engine
        return e.max_num_seqs + e.max_queued_requests

    def status(self) -> dict[str, Any]:
        mem = self.memory()
        return {
            "status": "ok" if self.healthy else "draining" if self.draining else (
                "restarting" if self.supervisor.restarting else "unavailable"),
            "worker_restarts": self.worker.restarts,
            "model_loaded": bool(self.models.loaded()),
            "default_model": self.models.default_name,
            "uptime_s": round(time.time() - self.started_at, 3),
            "requests_in_flight": self._inflight,
            "memory": {**mem, "budget_bytes": self.models.budget,
                       "models_bytes": self.models.used_bytes},
            "model_loads": dict(self.models.load_counts),
            "model_evictions": self.models.evictions,
            "models": [
                {
                    "name": lm.name,
                    "kind": lm.kind,
                    "pinned": lm.pinned,
                    "active_requests": lm.active,
                    "expires_at": None if lm.expires_at == float("inf") else lm.expires_at,
                    "running": lm.engine.num_running,
                    "waiting": lm.engine.num_waiting,
                    "max_batch_size_seen": lm.engine.max_batch_seen,
                    "memory_bytes": lm.size,
                    "context_length": lm.engine.context_length,
                    **({"prefix_cache": lm.engine.prefix_cache_stats()}
                       if hasattr(lm.engine, "prefix_cache_stats") else {}),
                    **({"vision_feature_cache": lm.engine.feature_cache_stats()}
                       if hasattr(lm.engine, "feature_cache_stats") else {}),
                    "loaded_at": lm.loaded_at,
                }
                for lm in self.models.loaded()
            ],
        }

    # -- generation ------------------------------------------------------------------------
    async def submit(self, req: GenerateRequest) -> Generation:
        """Admit, validate and tokenize ``req``; errors here are clean 4xx/5xx before any output.

        The returned Generation must be iterated or closed: that is what releases its slot.
        """
        if self.draining:
            raise Unavailable("the server is shutting down", headers={"Retry-After": "5"})
        if not self.healthy:
            raise Unavailable("the device worker is not running (restarting); retry shortly",
                              headers={"Retry-After": "2"})
        self.check_limits(req)
        note(model=self.models.resolve(req.model))
        if req.images:
            from mlxd.runtime.images import check_images

            check_images(self, req)  # 400 before any load: too many, or a text-only model
        if req.user:
            note(user=req.user)
        if self._inflight >= self.admission_limit:
            raise QueueFull(
                "too many requests queued; retry shortly", headers={"Retry-After": "1"}
            )
        self._inflight += 1
        lease = None
        t0 = time.perf_counter()
        try:
            lease = await self.models.acquire(req.model, req.keep_alive)
            t_acquired = time.perf_counter()
            engine = lease.engine
            self._check_engine_features(engine, req)
            if req.images or getattr(engine, "kind", None) == "vision":
                from mlxd.runtime.images import vision_prompt  # fetch, decode, process

                tokens, plan = await asyncio.to_thread(vision_prompt, self.settings, engine,
                                                       req), None
            else:
                tokens, plan = await asyncio.to_thread(self._tokenize_and_prepare, engine, req)
            params = self._fit_to_context(engine, req, len(tokens))
        except BaseException:
            self._inflight -= 1
            if lease is not None:
                lease.release()
            raise
        gen = Generation(self, lease, tokens, params, plan)
        gen.t_submitted, gen.t_acquired = t0, t_acquired
        return gen

    def check_limits(self, req: GenerateRequest) -> None:
        """Operator limits (security.max_tokens_limit, max_inputs): 400 before any work."""
        sec = self.settings.security
        n = req.sampling.max_tokens
        if sec.max_tokens_limit is not None and n is not None and n > sec.max_tokens_limit:
            raise InvalidRequest(
                f"max_tokens is {n}, more than this server allows ({sec.max_tokens_limit})",
                param="max_tokens",
            )
        if req.messages is not None and len(req.messages) > sec.max_inputs:
            raise InvalidRequest(
                f"{len(req.messages)} messages, more than this server allows "
                f"({sec.max_inputs})", param="messages",
            )

    def memory(self) -> dict[str, int]:
        """MLX's allocator view: what arrays hold, what its cache keeps, and the peak."""
        try:
            import mlx.core as mx

            return {"active_bytes": mx.get_active_memory(), "cache_bytes": mx.get_cache_memory(),
                    "peak_bytes": mx.get_peak_memory()}
        except Exception:  # noqa: BLE001
            return {}

    # -- encoders (runtime/encoders.py) ----------------------------------------------------
    async def embed(self, req: Any) -> Any:
        return await self.encoders.embed(req)

    async def rerank(self, req: Any) -> Any:
        return await self.encoders.rerank(req)

    async def tokenize(self, model: str | None, inputs: list[str] | None, **kw: Any) -> Any:
        return await self.encoders.tokenize(model, inputs, **kw)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        gen = await self.submit(req)
        async for event in gen:
            yield event

    # -- the model catalog ---------------------------------------------------------------
    async def pull(self, name: str, *, kind: str | None = None,
                   progress: Callable[[dict], None] | None = None) -> dict:
        """Pull into the store off the event loop; ``progress`` is called on the loop."""
        from mlxd.store.pull import pull as store_pull
        from mlxd.store.pull import resolve

        # A name from the network never reaches a local path or a pip spec; aliases the
        # operator configured still may.
        resolve(name, self.settings.models, allow_local=False)
        loop = asyncio.get_running_loop()

        def cb(event: dict) -> None:
            if progress is not None:
                loop.call_soon_threadsafe(progress, dict(event))

        return await asyncio.to_thread(store_pull, self.models.store, name,
                                       self.settings.models, kind=kind, progress=cb)

    async def delete(self, name: str) -> None:
        from mlxd.store.pull import remove

        await asyncio.to_thread(remove, self.models.store, name)
        self.models.forget_store_entry(name)

    def describe(self, name: str) -> dict[str, Any]:
        """What /api/show tells: manifest, config.json, chat template."""
        name = self.models.resolve(name)
        path = self.models.model_path(name)
        if path is None:
            raise ModelNotFound(f"model '{name}' not found", param="model")
        config = _read_json(path / "config.json")
        tok_cfg = _read_json(path / "tokenizer_config.json")
        template = tok_cfg.get("chat_template")
        if isinstance(template, list):
            template = next((t.get("template") for t in template if t.get("name") == "default"),
                            None)
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        manifest = self.models.store.manifest(name) or {"name": name, "kind": "chat",
                                                        "source": str(path)}
        return {"name": name, "path": str(path), "manifest": manifest, "config": config,
                "chat_template": template or ""}

    async def count_tokens(self, req: GenerateRequest) -> tuple[str, int]:
        """(model name, prompt tokens) of ``req`` as it would be generated: templated with
        its tools; loads the model if it has to."""
        lease = await self.models.acquire(req.model, req.keep_alive)
        try:
            note(model=lease.engine.name)
            tokens = await asyncio.to_thread(self._tokenize, lease.engine, req)
            return lease.engine.name, len(tokens)
        finally:
            lease.release()

    @staticmethod
    def _check_engine_features(engine: Any, req: GenerateRequest) -> None:
        """Tools and structured output need an engine that prepares them: never ignored."""
        if hasattr(engine, "prepare") and getattr(engine, "kind", "chat") != "vision":
            return
        if req.constraint is not None:
            raise InvalidRequest(f"model '{engine.name}' does not support structured output "
                                 "yet", param="response_format")
        if req.tools and req.tool_choice != "none":
            raise InvalidRequest(f"model '{engine.name}' does not support tools yet",
                                 param="tools")

    @classmethod
    def _tokenize_and_prepare(cls, engine: Any, req: GenerateRequest) -> tuple[list[int], Any]:
        """Off the event loop: the prompt's tokens, and the engine's per-request plan (its
        grammar, compiled here so that an unsupported schema is a 400 before any output)."""
        tokens = cls._tokenize(engine, req)
        prepare = getattr(engine, "prepare", None)
        return tokens, (prepare(req, tokens) if prepare is not None else None)

    @staticmethod
    def _tokenize(engine: Any, req: GenerateRequest) -> list[int]:
        if req.prompt_tokens is not None:
            tokens = list(req.prompt_tokens)
            bad = [t for t in tokens if not 0 <= t < engine.vocab_size]
            if bad:
                raise InvalidRequest(f"token ids out of range: {bad[:5]}", param="prompt")
        elif req.messages is not None:
            encode = getattr(engine, "encode_request", None)
            tokens = encode(req) if encode is not None else engine.encode_messages(req.messages)
        else:
            tokens = engine.encode_prompt(req.prompt or "")
        if not tokens:
            raise InvalidRequest("the prompt is empty", param="prompt")
        return tokens

    def _fit_to_context(self, engine: Any, req: GenerateRequest, n_prompt: int):
        ctx = engine.context_length
        p = req.sampling
        if n_prompt >= ctx:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {ctx} tokens, but the prompt has "
                f"{n_prompt} tokens.",
                param="messages" if req.messages is not None else "prompt",
            )
        if p.logit_bias and any(not 0 <= t < engine.vocab_size for t in p.logit_bias):
            raise InvalidRequest("logit_bias names a token id outside the vocabulary",
                                 param="logit_bias")
        room = ctx - n_prompt
        cap = self.settings.security.max_tokens_limit or room
        if p.max_tokens is None:
            return replace(p, max_tokens=min(self.settings.engine.default_max_tokens, room, cap))
        if p.max_tokens < 0:  # "until the context is full"
            return replace(p, max_tokens=min(room, cap))
        if p.max_tokens > room:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{n_prompt + p.max_tokens} tokens ({n_prompt} in the prompt, {p.max_tokens} "
                "for the completion). Please reduce the prompt or max_tokens.",
                param="max_tokens",
            )
        return p



class Generation:
    """One admitted sequence: iterate it for events; leaving early cancels it on the device."""

    def __init__(self, runtime: Runtime, lease: Any, tokens: list[int], params: Any,
                 plan: Any = None) -> None:
        self._runtime = runtime
        self._lease = lease
        self.engine = engine = lease.engine
        self.model = engine.name
        self.prompt_tokens = tokens
        self.params = params
        self.plan = plan  # the engine's per-request extras (grammar, output parsing)
        self._released = False
        now = time.perf_counter()
        self.t_submitted = self.t_acquired = self.t_first = self.t_done = now
        self._obs = GenerationObserver(self)  # metrics and the request's usage

    def durations_ns(self) -> dict[str, int]:
        """Ollama-style timings: load, prompt evaluation (to the first token), generation."""
        ns = 1_000_000_000
        return {
            "total_duration": int((self.t_done - self.t_submitted) * ns),
            "load_duration": int((self.t_acquired - self.t_submitted) * ns),
            "prompt_eval_duration": int(max(self.t_first - self.t_acquired, 0) * ns),
            "eval_duration": int(max(self.t_done - self.t_first, 0) * ns),
        }

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._obs.close()
            self._runtime._inflight -= 1
            self._lease.release()

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        worker = self._runtime.worker
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[TokenEvent] = asyncio.Queue()
        if self.plan is not None:
            seq = self.engine.new_sequence(self.prompt_tokens, self.params, self.plan)
        else:
            seq = self.engine.new_sequence(self.prompt_tokens, self.params)
        seq.handle = (loop, q)
        worker.submit(self.engine, seq)
        done = False
        first = True
        try:
            while True:
                event = await q.get()
                if first:
                    self.t_first = time.perf_counter()
                    first = False
                self._obs.event(len(event.token_ids), event.finish_reason)
                if event.error is not None:
                    done = True
                    err = event.error
                    if isinstance(err, MlxdError):
                        raise err
                    if isinstance(err, WorkerDied):
                        raise Unavailable(f"{err}; it is being restarted, retry shortly",
                                          headers={"Retry-After": "2"}) from err
                    if is_out_of_memory(err):
                        raise OutOfMemory(
                            f"out of memory while generating ({err}); the batch was "
                            "cancelled to free memory. Retry, or lower max_tokens or "
                            "engine.max_num_seqs", headers={"Retry-After": "1"}) from err
                    raise EngineError(f"generation failed: {err}") from err
                if event.finish_reason is not None:
                    done = True
                    self.t_done = time.perf_counter()
                yield event
                if done:
                    return
        finally:
            if not done:
                worker.cancel(self.engine, seq)
            self._release()

    def close(self) -> None:
        """For a Generation that will never be iterated."""
        self._release()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
