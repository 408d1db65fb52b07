"""Ollama's embedding endpoints, in Ollama's shapes (errors are Ollama's, by path).

* ``POST /api/embed`` ``{model, input: str | [str], truncate, keep_alive, options,
  dimensions}`` -> ``{model, embeddings: [[...]], total_duration, load_duration,
  prompt_eval_count}``; no input (or an empty list) only loads the model, as in Ollama.
* ``POST /api/embeddings`` (legacy) ``{model, prompt}`` -> ``{embedding: [...]}``; an empty
  prompt loads the model and returns an empty embedding, as in Ollama.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import Field

from mlxd.api.bodies import OllamaEmbed, OllamaLegacyEmbedding, json_body
from mlxd.api.common import runtime
from mlxd.api.docs import ok
from mlxd.api.routing import ApiRoute
from mlxd.api.streaming import until_disconnect
from mlxd.api.wire import KeepAlive, ModelName, WireModel
from mlxd.core.types import EmbedRequest

router = APIRouter(prefix="/api", route_class=ApiRoute)


class _Body(WireModel):
    pass


class EmbedBody(_Body):
    model: ModelName | None = None
    input: str | list[str] | None = None
    truncate: bool = True
    keep_alive: KeepAlive = None
    options: dict[str, Any] | None = None  # accepted; nothing in it applies to encoders
    dimensions: int | None = Field(None, ge=1)


class EmbeddingsBody(_Body):
    model: ModelName | None = None
    prompt: str = ""
    keep_alive: KeepAlive = None
    options: dict[str, Any] | None = None


def _name(request: Request, model: str | None) -> str:
    return model or runtime(request).settings.models.default_embedding


@router.post("/embed", responses=ok(OllamaEmbed))
async def embed(request: Request, body: EmbedBody) -> Response:
    rt = runtime(request)
    inputs = [body.input] if isinstance(body.input, str) else list(body.input or [])
    if not inputs:
        entry = await rt.models.touch(_name(request, body.model), body.keep_alive)
        return json_body(OllamaEmbed(model=entry.name, embeddings=[]))
    req = EmbedRequest(
        model=_name(request, body.model),
        inputs=inputs,  # type: ignore[arg-type]
        truncate=body.truncate,
        dimensions=body.dimensions,
        keep_alive=body.keep_alive,
        request_id=request.state.request_id,
    )
    res = await until_disconnect(request, rt.embed(req))
    return json_body(
        OllamaEmbed(
            model=res.model,
            embeddings=res.vectors.tolist(),
            **res.timings.durations_ns(),
            prompt_eval_count=res.prompt_tokens,
        )
    )


@router.post("/embeddings", responses=ok(OllamaLegacyEmbedding))
async def embeddings(request: Request, body: EmbeddingsBody) -> Response:
    rt = runtime(request)
    if not body.prompt:
        await rt.models.touch(_name(request, body.model), body.keep_alive)
        return json_body(OllamaLegacyEmbedding(embedding=[]))
    req = EmbedRequest(
        model=_name(request, body.model),
        inputs=[body.prompt],
        keep_alive=body.keep_alive,
        request_id=request.state.request_id,
    )
    res = await until_disconnect(request, rt.embed(req))
    return json_body(OllamaLegacyEmbedding(embedding=res.vectors[0].tolist()))
