"""The FastAPI app factory: routers, middleware, error handlers, and the runtime's lifespan."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request, Response

from mlxd import __version__
from mlxd.api import (
    audio,
    batches,
    encoders,
    lora,
    metrics,
    ollama,
    ollama_embed,
    openai,
    simple,
    usage,
)
from mlxd.api.anthropic import router as anthropic_router
from mlxd.api.errors import install_error_handlers
from mlxd.api.middleware import install_middleware
from mlxd.api.responses import router as responses_router
from mlxd.api.streaming import ClientGone
from mlxd.config import Settings
from mlxd.frontend.runtime import Runtime
from mlxd.observability import tracing
from mlxd.observability.usage import UsageStore


def create_app(settings: Settings, runtime: Runtime | None = None) -> FastAPI:
    rt = runtime or Runtime(settings)

    sampler = None
    flushing: Any = None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        traced = tracing.setup(settings.observability.otlp_traces_endpoint, "api", __version__)
        await rt.start()
        if sampler is not None:
            sampler.start()
        runner = batches.start_runner(app)  # Batch API jobs (api/batch_runner.py)
        try:
            async with flushing() if flushing is not None else contextlib.nullcontext():
                yield
        finally:
            if runner is not None:
                await runner.stop()
            if sampler is not None:
                await sampler.stop()
            await rt.stop()
            await app.state.rate_limits.aclose()
            if traced:
                await asyncio.to_thread(tracing.shutdown)

    app = FastAPI(title="mlxd", version=__version__, lifespan=lifespan)
    app.state.runtime = rt
    app.state.settings = settings
    if settings.usage.enabled:  # the path now: a test's later MLXD_HOME must not move it
        store = UsageStore(settings.home / "mlxd.sqlite3", settings.usage.retention_days)
        flushing = usage.install_usage(app, store, settings.usage.flush_interval_s)
    install_error_handlers(app)

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    install_middleware(app, settings)  # request id/log/metrics, Host/Origin, CORS, keys
    app.include_router(openai.router)
    app.include_router(anthropic_router)  # /v1/messages, /v1/messages/count_tokens
    app.include_router(responses_router)  # /v1/responses
    app.include_router(simple.router)
    app.include_router(ollama.router)
    app.include_router(encoders.router)  # /v1/embeddings, /v1/rerank, /v1/tokenize
    app.include_router(ollama_embed.router)  # /api/embed, /api/embeddings
    app.include_router(audio.uploads)  # /v1/audio/transcriptions, /v1/audio/translations
    app.include_router(audio.router)  # /v1/audio/speech
    app.include_router(lora.router)  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    batches.install(app)  # /v1/files, /v1/batches
    app.include_router(metrics.router)
    app.include_router(usage.router)  # /v1/usage
    if settings.server.ui:
        from mlxd.api.ui import install_ui

        sampler = install_ui(app)  # /, /ui/, /ui/static/, /ui/api/*
    return app
