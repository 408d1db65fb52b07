"""The simple dialect (/generate) and the operational endpoints (/health)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from mlxd.api.common import collect, runtime, usage_dict
from mlxd.api.errors import error_payload
from mlxd.api.schemas import GenerateBody
from mlxd.api.streaming import sse, sse_response, until_disconnect
from mlxd.core.errors import InvalidRequest, MlxdError
from mlxd.core.types import GenerateRequest
from mlxd.frontend.generation import Generation

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    rt = runtime(request)
    status = await rt.status()
    return JSONResponse(status, status_code=200 if rt.healthy else 503)


async def _json_body(request: Request) -> GenerateBody:
    """The simple dialect takes JSON whatever the Content-Type (``curl -d`` sends form type)."""
    raw = await request.body()
    try:
        data = json.loads(raw or b"null")
    except ValueError:
        raise InvalidRequest("the request body is not valid JSON") from None
    try:
        return GenerateBody.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


@router.post("/generate")
async def generate(request: Request, body: GenerateBody = Depends(_json_body)):
    req = GenerateRequest(
        model=body.model,
        sampling=body.to_sampling(),
        prompt=None if body.chat else body.prompt,
        messages=[{"role": "user", "content": body.prompt}] if body.chat else None,
        request_id=request.state.request_id,
        keep_alive=body.keep_alive,
    )
    gen = await until_disconnect(request, runtime(request).submit(req))
    if body.stream:
        return sse_response(_stream(gen), gen.close)
    res = await until_disconnect(request, collect(gen))
    return {"text": res.text, "model": gen.model, "finish_reason": res.finish_reason,
            "usage": usage_dict(res.usage)}


async def _stream(gen: Generation) -> AsyncIterator[str]:
    try:
        async for ev in gen:
            if ev.text:
                yield sse({"text": ev.text})
            if ev.finish_reason is not None:
                yield sse({"text": "", "finish_reason": ev.finish_reason,
                           "usage": usage_dict(ev.usage) if ev.usage else None})
    except MlxdError as exc:
        yield sse(error_payload(exc))
    yield sse("[DONE]")


class UnloadBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None


@router.post("/unload")
async def unload(request: Request):
    """Unload one model (``{"model": ...}``) or all; memory goes back to the system."""
    raw = await request.body()
    try:
        body = UnloadBody.model_validate(json.loads(raw) if raw.strip() else {})
    except ValueError as exc:
        raise InvalidRequest(f"invalid body: {exc}") from None
    result = await runtime(request).models.unload(body.model)
    return result
