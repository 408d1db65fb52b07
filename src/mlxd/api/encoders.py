"""Embeddings, reranking and token counting: OpenAI, Jina/Cohere and vLLM-style shapes.

* ``POST /v1/embeddings``: OpenAI's request and response (``encoding_format`` float or
  base64 little-endian float32, ``dimensions``, ``usage``), plus ``truncate`` (default
  true; false turns an over-long input into a 400) and ``keep_alive``.
* ``POST /v1/rerank`` (also ``/rerank`` and ``/v2/rerank``): Jina's shape, and Cohere's field
  names in the same handler (``rank_fields``, ``max_chunks_per_doc`` ignored, ``meta``);
  ``return_text`` + ``decision_threshold`` add a "yes"/"no" ``text_output`` per result.
* ``POST /v1/tokenize``: token counts with any model's tokenizer, in the shape of the
  embeddings server mlxd replaces: ``data[i] = {"index": i, "tokens": <count>}``, plus the
  ids under ``token_ids`` with ``return_tokens``; ``messages`` counts a chat-templated
  prompt.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request, Response
from pydantic import Field

from mlxd.api.bodies import (
    Embedding,
    EmbeddingList,
    RerankMeta,
    RerankResponse,
    RerankResult,
    RerankTokens,
    RerankUnits,
    RerankVersion,
    TokenCount,
    TokenizeResponse,
    Usage,
    json_body,
)
from mlxd.api.common import new_id, runtime
from mlxd.api.docs import ok
from mlxd.api.routing import ApiRoute
from mlxd.api.schemas import ChatCompletionRequest, ChatMessage
from mlxd.api.streaming import until_disconnect
from mlxd.api.wire import KeepAlive, ModelName, WireModel, is_token_ids
from mlxd.core.errors import InvalidRequest
from mlxd.core.types import EmbedRequest, RerankRequest

router = APIRouter(route_class=ApiRoute)


class _Req(WireModel):
    pass


def f32_base64(v: np.ndarray) -> str:
    """OpenAI's base64 encoding: the raw little-endian float32 bytes."""
    a = np.asarray(v, dtype="<f4")
    return base64.b64encode(a.tobytes()).decode("ascii")


# -- embeddings ---------------------------------------------------------------------------------


class EmbeddingsBody(_Req):
    # the openai client sends encoding_format: null when its caller passes None
    NULL_IS_DEFAULT = frozenset({"encoding_format"})

    input: str | list[str] | list[int] | list[list[int]]
    model: ModelName | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    truncate: bool = Field(
        True,
        description="mlxd/TEI extension: cut over-long inputs to the model's maximum (false: 400).",
    )
    keep_alive: KeepAlive = None

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str):
            return [x]
        if is_token_ids(x):
            return [list(x)] if x else []
        return list(x)


@router.post("/v1/embeddings", responses=ok(EmbeddingList))
async def embeddings(request: Request, body: EmbeddingsBody) -> Response:
    req = EmbedRequest(
        model=body.model,
        inputs=body.inputs(),
        truncate=body.truncate,
        dimensions=body.dimensions,
        keep_alive=body.keep_alive,
        request_id=request.state.request_id,
    )
    res = await until_disconnect(request, runtime(request).embed(req))
    b64 = body.encoding_format == "base64"
    data = [
        Embedding(index=i, embedding=f32_base64(v) if b64 else v.tolist())
        for i, v in enumerate(res.vectors)
    ]
    n = res.prompt_tokens
    return json_body(
        EmbeddingList(data=data, model=res.model, usage=Usage(prompt_tokens=n, total_tokens=n))
    )


# -- reranking ---------------------------------------------------------------------------------


class RerankBody(_Req):
    model: ModelName | None = None
    query: str
    documents: list[str | dict[str, Any]]
    top_n: int | None = Field(None, ge=1)
    return_documents: bool | None = None
    rank_fields: list[str] | None = None  # Cohere v1: which fields of object documents
    max_chunks_per_doc: int | None = None  # Cohere v1: accepted and ignored
    max_tokens_per_doc: int | None = Field(None, ge=1)  # Cohere v2: accepted and ignored
    return_text: bool = Field(False, description="Add text_output 'yes'/'no' per result.")
    decision_threshold: float = Field(
        0.5, ge=0.0, le=1.0, description="Score from which text_output is 'yes'."
    )
    truncate: bool = True
    instruction: str | None = Field(None, description="LLM rerankers: the task to judge by.")
    keep_alive: KeepAlive = None

    def texts(self) -> list[str]:
        out = []
        fields = self.rank_fields or ["text"]
        for i, d in enumerate(self.documents):
            if isinstance(d, str):
                out.append(d)
                continue
            present = [f for f in fields if f in d]
            if not present:
                raise InvalidRequest(
                    f"documents[{i}] has none of the fields {fields}", param=f"documents[{i}]"
                )
            vals = [d[f] for f in present]
            if any(not isinstance(v, (str, int, float)) for v in vals):
                raise InvalidRequest(
                    f"documents[{i}]: ranked fields must be text", param=f"documents[{i}]"
                )
            if len(present) == 1:
                out.append(str(vals[0]))
            else:
                out.append("\n".join(f"{f}: {v}" for f, v in zip(present, vals, strict=True)))
        return out


async def _rerank(body: RerankBody, request: Request, cohere_v2: bool) -> Response:
    texts = body.texts()
    req = RerankRequest(
        model=body.model,
        query=body.query,
        documents=texts,
        truncate=body.truncate,
        instruction=body.instruction,
        keep_alive=body.keep_alive,
        request_id=request.state.request_id,
    )
    res = await until_disconnect(request, runtime(request).rerank(req))
    order = sorted(range(len(texts)), key=lambda i: (-res.scores[i], i))
    if body.top_n is not None:
        order = order[: body.top_n]
    with_docs = body.return_documents if body.return_documents is not None else not cohere_v2
    results = []
    for i in order:
        r = RerankResult(index=i, relevance_score=res.scores[i])
        if with_docs:
            d = body.documents[i]
            r.document = {"text": d} if isinstance(d, str) else d
        if body.return_text:
            r.text_output = "yes" if res.scores[i] >= body.decision_threshold else "no"
        results.append(r)
    n = res.prompt_tokens
    return json_body(
        RerankResponse(
            id=request.state.request_id or new_id("rerank"),
            model=res.model,
            results=results,
            usage=Usage(prompt_tokens=n, total_tokens=n),
            meta=RerankMeta(
                api_version=RerankVersion(version="2" if cohere_v2 else "1"),
                billed_units=RerankUnits(search_units=1, input_tokens=n),
                tokens=RerankTokens(input_tokens=n, output_tokens=0),
            ),
        )
    )


@router.post("/v1/rerank", responses=ok(RerankResponse))
async def rerank_v1(request: Request, body: RerankBody) -> Response:
    return await _rerank(body, request, cohere_v2=False)


@router.post("/rerank", responses=ok(RerankResponse))
async def rerank_plain(request: Request, body: RerankBody) -> Response:
    return await _rerank(body, request, cohere_v2=False)


@router.post("/v2/rerank", responses=ok(RerankResponse))
async def rerank_v2(request: Request, body: RerankBody) -> Response:
    return await _rerank(body, request, cohere_v2=True)


# -- token counting -------------------------------------------------------------------------------


class TokenizeBody(_Req):
    model: ModelName | None = None
    input: str | list[str] | None = None
    prompt: str | list[str] | None = Field(None, description="Alias of input (vLLM's name).")
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    return_tokens: bool = Field(False, description="Add each input's ids as token_ids.")
    return_token_strings: bool = False
    keep_alive: KeepAlive = None


@router.post("/v1/tokenize", responses=ok(TokenizeResponse))
async def tokenize(request: Request, body: TokenizeBody) -> Response:
    raw = body.input if body.input is not None else body.prompt
    messages = None
    if body.messages is not None:
        if raw is not None:
            raise InvalidRequest("send either input or messages, not both", param="messages")
        messages = (
            ChatCompletionRequest(messages=body.messages).template_messages()
            if body.messages
            else []
        )
        texts = None
    else:
        if raw is None:
            raise InvalidRequest("input (or messages) is required", param="input")
        texts = [raw] if isinstance(raw, str) else list(raw)
    res = await until_disconnect(
        request,
        runtime(request).tokenize(
            body.model,
            texts,
            messages=messages,
            add_special_tokens=body.add_special_tokens,
            token_strings=body.return_token_strings,
            keep_alive=body.keep_alive,
        ),
    )
    data = []
    for i, ids in enumerate(res.tokens):
        item = TokenCount(index=i, tokens=len(ids))
        if body.return_tokens:
            item.token_ids = ids
        if res.token_strings is not None:
            item.token_strings = res.token_strings[i]
        data.append(item)
    total = sum(len(t) for t in res.tokens)
    return json_body(
        TokenizeResponse(
            model=res.model,
            data=data,
            count=total,
            context_length=res.context_length,
            usage=Usage(prompt_tokens=total, total_tokens=total),
        )
    )
