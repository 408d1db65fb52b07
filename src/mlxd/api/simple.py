"""The simple dialect (/generate) and the operational endpoints (/health)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ConfigDict

from mlxd import __version__
from mlxd.api.bodies import GenerateResponse, Health, json_body
from mlxd.api.common import collect, runtime, usage_body, usage_dict
from mlxd.api.docs import SSE, ok
from mlxd.api.errors import error_payload
from mlxd.api.routing import ApiRoute
from mlxd.api.schemas import GenerateBody
from mlxd.api.streaming import sse, sse_response, until_disconnect
from mlxd.api.wire import ModelName, WireModel
from mlxd.core.errors import MlxdError, ModelNotFound
from mlxd.core.types import GenerateRequest
from mlxd.frontend.generation import Generation

router = APIRouter(route_class=ApiRoute)


@router.get("/health", responses=ok(Health))
@router.head("/health", include_in_schema=False)  # probes that only want the status code
async def health(request: Request) -> Response:
    """The server's state. With API keys configured, a caller without a valid key (a load
    balancer's probe) gets only ``{"status"}`` and the status code: which models are loaded,
    memory, load and the version are for key holders (api/security.py marks the request
    ``anonymous``)."""
    rt = runtime(request)
    # the code comes from the same snapshot as the status word (a core may die meanwhile)
    if getattr(request.state, "anonymous", False):
        state = rt.state
        return JSONResponse({"status": state}, status_code=rt.health_code(state))
    status = await rt.status()
    status["version"] = __version__
    return JSONResponse(status, status_code=rt.health_code(status["status"]))


async def _has_chat_template(request: Request, model: str) -> bool:
    """Whether ``model`` ships a chat template (read from its files, as /api/show does; a
    model not installed yet is assumed to have one, as nearly every chat model does)."""
    try:
        info = await asyncio.to_thread(runtime(request).catalog_ops.describe, model)
    except ModelNotFound:
        return True
    return bool(info["chat_template"])


@router.post(
    "/generate",
    responses=ok(
        GenerateResponse, (SSE, '{"text"} events, the last with finish_reason, then [DONE]')
    ),
)
async def generate(body: GenerateBody, request: Request) -> Response:
    # the model's files are read only when the request leaves the choice to the model
    decided = body.raw or body.chat is not None
    chat = body.templated(decided or await _has_chat_template(request, body.model))
    req = GenerateRequest(
        model=body.model,
        sampling=body.to_sampling(),
        prompt=None if chat else body.prompt,
        messages=[{"role": "user", "content": body.prompt}] if chat else None,
        request_id=request.state.request_id,
        keep_alive=body.keep_alive,
        cache_salt=body.cache_salt,
        priority=body.priority,
    )
    gen = await until_disconnect(request, runtime(request).submit(req))
    if body.stream:
        return sse_response(_stream(gen), gen.close)
    res = await until_disconnect(request, collect(gen))
    return json_body(
        GenerateResponse(
            text=res.text,
            model=gen.model,
            finish_reason=res.finish_reason,
            usage=usage_body(res.usage),
        )
    )


async def _stream(gen: Generation) -> AsyncIterator[str]:
    try:
        async for ev in gen:
            if ev.text:
                yield sse({"text": ev.text})
            if ev.finish_reason is not None:
                yield sse(
                    {
                        "text": "",
                        "finish_reason": ev.finish_reason,
                        "usage": usage_dict(ev.usage) if ev.usage else None,
                    }
                )
    except MlxdError as exc:
        yield sse(error_payload(exc))
    yield sse("[DONE]")


class UnloadBody(WireModel):
    model_config = ConfigDict(extra="forbid")
    model: ModelName | None = None


@router.post("/unload")
async def unload(request: Request, body: UnloadBody | None = None) -> dict[str, Any]:
    """Unload one model (``{"model": ...}``) or all (no body); memory goes back to the
    system (the answer carries the engine core's memory after the unload)."""
    return await runtime(request).models.unload(body.model if body else None)
