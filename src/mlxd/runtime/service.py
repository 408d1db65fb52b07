"""The runtime facade the API dialects call: admission, validation, streaming of events."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from mlxd.config import Settings
from mlxd.core.errors import (
    ContextLengthExceeded,
    EngineError,
    InvalidRequest,
    MlxdError,
    QueueFull,
    Unavailable,
)
from mlxd.core.types import GenerateRequest, TokenEvent
from mlxd.runtime.models import ModelManager
from mlxd.runtime.worker import DeviceWorker

log = logging.getLogger(__name__)


class Runtime:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.worker = DeviceWorker()
        self.models = ModelManager(settings, self.worker)
        self.started_at = time.time()
        self._inflight = 0

    async def start(self) -> None:
        self.models.store.clean_temp()
        self.worker.start()
        for name in dict.fromkeys([self.models.default_name, *self.models.preload_names]):
            await self.models.get(name)

    async def stop(self) -> None:
        await self.models.unload_all()
        self.worker.stop()

    # -- status ----------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self.worker.alive

    @property
    def admission_limit(self) -> int:
        e = self.settings.engine
        return e.max_num_seqs + e.max_queued_requests

    def status(self) -> dict[str, Any]:
        return {
            "status": "ok" if self.healthy else "unavailable",
            "model_loaded": bool(self.models.loaded()),
            "default_model": self.models.default_name,
            "uptime_s": round(time.time() - self.started_at, 3),
            "requests_in_flight": self._inflight,
            "models": [
                {
                    "name": lm.name,
                    "kind": lm.engine.kind,
                    "running": lm.engine.num_running,
                    "waiting": lm.engine.num_waiting,
                    "max_batch_size_seen": lm.engine.max_batch_seen,
                    "memory_bytes": lm.engine.nbytes,
                    "context_length": lm.engine.context_length,
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
        if not self.healthy:
            raise Unavailable("the device worker is not running")
        if self._inflight >= self.admission_limit:
            raise QueueFull(
                "too many requests queued; retry shortly", headers={"Retry-After": "1"}
            )
        self._inflight += 1
        try:
            engine = await self.models.get(req.model)
            tokens = await asyncio.to_thread(self._tokenize, engine, req)
            params = self._fit_to_context(engine, req, len(tokens))
        except BaseException:
            self._inflight -= 1
            raise
        return Generation(self, engine, tokens, params)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenEvent]:
        gen = await self.submit(req)
        async for event in gen:
            yield event

    @staticmethod
    def _tokenize(engine: Any, req: GenerateRequest) -> list[int]:
        if req.prompt_tokens is not None:
            tokens = list(req.prompt_tokens)
            bad = [t for t in tokens if not 0 <= t < engine.vocab_size]
            if bad:
                raise InvalidRequest(f"token ids out of range: {bad[:5]}", param="prompt")
        elif req.messages is not None:
            tokens = engine.encode_messages(req.messages)
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
        if p.max_tokens is None:
            return replace(p, max_tokens=min(self.settings.engine.default_max_tokens, room))
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

    def __init__(self, runtime: Runtime, engine: Any, tokens: list[int], params: Any) -> None:
        self._runtime = runtime
        self.engine = engine
        self.model = engine.name
        self.prompt_tokens = tokens
        self.params = params
        self._released = False

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self._runtime._inflight -= 1

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        worker = self._runtime.worker
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[TokenEvent] = asyncio.Queue()
        seq = self.engine.new_sequence(self.prompt_tokens, self.params)
        seq.handle = (loop, q)
        worker.submit(self.engine, seq)
        done = False
        try:
            while True:
                event = await q.get()
                if event.error is not None:
                    done = True
                    err = event.error
                    if isinstance(err, MlxdError):
                        raise err
                    raise EngineError(f"generation failed: {err}") from err
                if event.finish_reason is not None:
                    done = True
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
