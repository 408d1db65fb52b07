"""The OpenAI dialect: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request, Response

from mlxd.api.bodies import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    FunctionCall,
    ModelCard,
    ModelList,
    TokenLogprobOut,
    ToolCallOut,
    TopLogprobOut,
    json_body,
)
from mlxd.api.common import (
    Collected,
    close_all,
    collect_all,
    merged,
    new_id,
    now,
    runtime,
    submit_n,
    total_usage,
    usage_body,
    usage_dict,
)
from mlxd.api.docs import SSE, ok
from mlxd.api.errors import error_payload
from mlxd.api.reasoning import apply_reasoning
from mlxd.api.routing import ApiRoute, RouteOptions
from mlxd.api.schemas import ChatCompletionRequest, CompletionRequest
from mlxd.api.streaming import sse, sse_response, until_disconnect
from mlxd.api.tooling import (
    apply_tools,
    openai_response_format,
    openai_tool_calls,
    openai_tool_choice,
    openai_tools,
)
from mlxd.core.errors import MlxdError, ModelNotFound
from mlxd.core.render import check_template_kwargs
from mlxd.core.types import GenerateRequest, TokenLogprob, TopLogprob
from mlxd.frontend.adapters import AdapterEntry
from mlxd.frontend.generation import Generation
from mlxd.frontend.models import LoadedModel
from mlxd.frontend.runtime import Runtime

router = APIRouter(route_class=ApiRoute)

# mlx-vlm's server serves the OpenAI routes without the /v1 prefix; clients written for it
# work unchanged. Same handlers; left out of the OpenAPI document, which lists each once.
ALIAS: RouteOptions = {"include_in_schema": False}

# The floor OpenAI and vLLM report for a token the model gives no chance (-inf): JSON has no
# infinities, and a NaN or -Infinity in a chunk breaks every strict client's parser.
LOGPROB_FLOOR = -9999.0


def finite_logprob(x: float) -> float:
    """A logprob as JSON can carry it: -inf and NaN become the floor, never below it."""
    return max(x, LOGPROB_FLOOR) if math.isfinite(x) else LOGPROB_FLOOR


def _name(t: TokenLogprob | TopLogprob, ids: bool) -> str:
    """A token as logprobs name it: its text, or (``return_tokens_as_token_ids``, vLLM's
    spelling) ``token_id:<id>``."""
    return f"token_id:{t.token_id}" if ids else t.token


def _chat_logprobs(items: list[TokenLogprob], ids: bool = False) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            TokenLogprobOut(
                token=_name(lp, ids),
                logprob=finite_logprob(lp.logprob),
                bytes=list(lp.token.encode()),
                top_logprobs=[
                    TopLogprobOut(
                        token=_name(t, ids),
                        logprob=finite_logprob(t.logprob),
                        bytes=list(t.token.encode()),
                    )
                    for t in lp.top
                ],
            )
            for lp in items
        ]
    )


def _completion_logprobs(
    items: list[TokenLogprob], offset: int = 0, ids: bool = False
) -> CompletionLogprobs:
    offsets, pos = [], offset
    for lp in items:
        offsets.append(pos)
        pos += len(lp.token)
    return CompletionLogprobs(
        tokens=[_name(lp, ids) for lp in items],
        token_logprobs=[finite_logprob(lp.logprob) for lp in items],
        top_logprobs=[{_name(t, ids): finite_logprob(t.logprob) for t in lp.top} for lp in items],
        text_offset=offsets,
    )


def _dumped(model: ChatLogprobs | CompletionLogprobs | None) -> dict[str, Any] | None:
    """A streamed chunk's logprobs (chunks are framed by hand: see _chat_stream)."""
    return None if model is None else model.model_dump(mode="json")


@router.post(
    "/v1/chat/completions",
    responses=ok(ChatCompletion, (SSE, "chat.completion.chunk objects, then [DONE]")),
)
@router.post("/chat/completions", **ALIAS)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    req = GenerateRequest(
        model=body.model,
        sampling=body.to_sampling(),
        messages=body.template_messages(),
        request_id=request.state.request_id,
        keep_alive=body.keep_alive,
        images=body.images(),
        audio=body.audio(),
        cache_salt=body.cache_salt,
        priority=body.priority,
    )
    _chat_extras(req, body)
    apply_reasoning(
        req, runtime(request).settings, body.thinking_token_budget, body.reasoning_effort
    )
    gens = await submit_n(request, req, body.n)
    gen = gens[0]
    cid, created = new_id("chatcmpl"), now()
    if body.stream:
        return sse_response(
            _chat_stream(gens, cid, created, body.include_usage, body.return_tokens_as_token_ids),
            close_all(gens),
        )
    try:
        results = await until_disconnect(request, collect_all(gens))
    finally:
        close_all(gens)()
    return json_body(
        ChatCompletion(
            id=cid,
            created=created,
            model=gen.model,
            choices=[
                ChatChoice(
                    index=i,
                    message=_chat_message(res),
                    logprobs=_chat_logprobs(res.logprobs, body.return_tokens_as_token_ids)
                    if gen.params.logprobs
                    else None,
                    finish_reason=res.finish_reason,
                )
                for i, res in enumerate(results)
            ],
            usage=usage_body(total_usage(results)),
        )
    )


def _chat_extras(req: GenerateRequest, body: ChatCompletionRequest) -> None:
    """Tools, tool choice, structured output, template variables and the end user."""
    tools = openai_tools(body.tools)
    apply_tools(req, tools, openai_tool_choice(body.tool_choice, tools), body.parallel_tool_calls)
    req.constraint = openai_response_format(body.response_format)
    req.template_kwargs = check_template_kwargs(body.chat_template_kwargs)
    req.user = body.user


def _chat_message(res: Collected) -> AssistantMessage:
    msg = AssistantMessage(content=res.text if (res.text or not res.tool_calls) else None)
    if res.reasoning:
        msg.reasoning_content = res.reasoning
    if res.tool_calls:
        msg.tool_calls = [
            ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in res.tool_calls
        ]
    return msg


async def _chat_stream(
    gens: list[Generation], cid: str, created: int, include_usage: bool, ids: bool = False
) -> AsyncIterator[str]:
    gen = gens[0]
    base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": gen.model}
    extra = {"usage": None} if include_usage else {}

    def chunk(
        delta: dict, finish: str | None = None, logprobs: dict | None = None, index: int = 0
    ) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse({**base, "choices": [choice], **extra})

    # The per-token chunk differs only in its text: frame it around one json.dumps of the
    # delta instead of building and serialising the whole object for every token.
    head, _, tail = chunk({"content": "\x00"}).partition('"\\u0000"')
    want_logprobs = gen.params.logprobs
    n_calls = [0] * len(gens)
    finished: list = [None] * len(gens)

    for i in range(len(gens)):
        yield chunk({"role": "assistant", "content": ""}, index=i)
    try:
        async for i, ev in merged(gens):
            if ev.reasoning:
                yield chunk({"reasoning_content": ev.reasoning}, index=i)
            if want_logprobs and (ev.text or ev.logprobs):
                lp = _dumped(_chat_logprobs(ev.logprobs, ids))
                yield chunk({"content": ev.text}, None, lp, index=i)
            elif ev.text:
                yield (
                    head + json.dumps(ev.text) + tail
                    if i == 0
                    else chunk({"content": ev.text}, index=i)
                )
            if ev.tool_calls:
                yield chunk({"tool_calls": openai_tool_calls(ev.tool_calls, n_calls[i])}, index=i)
                n_calls[i] += len(ev.tool_calls)
            if ev.finish_reason is not None:
                finished[i] = ev.usage
                yield chunk({}, ev.finish_reason, index=i)
        if include_usage and all(u is not None for u in finished):
            results = [Collected(usage=u) for u in finished]
            yield sse({**base, "choices": [], "usage": usage_dict(total_usage(results))})
    except MlxdError as exc:
        yield sse(error_payload(exc))
    yield sse("[DONE]")


@router.post(
    "/v1/completions", responses=ok(Completion, (SSE, "text_completion chunks, then [DONE]"))
)
async def completions(body: CompletionRequest, request: Request) -> Response:
    text, tokens = body.single_prompt()
    req = GenerateRequest(
        model=body.model,
        sampling=body.to_sampling(),
        prompt=text,
        prompt_tokens=tokens,
        request_id=request.state.request_id,
        keep_alive=body.keep_alive,
        cache_salt=body.cache_salt,
        priority=body.priority,
    )
    req.user = body.user
    gens = await submit_n(request, req, body.n)
    gen = gens[0]
    cid, created = new_id("cmpl"), now()
    if body.stream:
        return sse_response(
            _completion_stream(
                gens, cid, created, body.include_usage, body.return_tokens_as_token_ids
            ),
            close_all(gens),
        )
    try:
        results = await until_disconnect(request, collect_all(gens))
    finally:
        close_all(gens)()
    return json_body(
        Completion(
            id=cid,
            created=created,
            model=gen.model,
            choices=[
                CompletionChoice(
                    index=i,
                    text=res.text,
                    logprobs=_completion_logprobs(res.logprobs, ids=body.return_tokens_as_token_ids)
                    if gen.params.logprobs
                    else None,
                    finish_reason=res.finish_reason,
                )
                for i, res in enumerate(results)
            ],
            usage=usage_body(total_usage(results)),
        )
    )


async def _completion_stream(
    gens: list[Generation], cid: str, created: int, include_usage: bool, ids: bool = False
) -> AsyncIterator[str]:
    gen = gens[0]
    base = {"id": cid, "object": "text_completion", "created": created, "model": gen.model}
    extra = {"usage": None} if include_usage else {}
    offsets = [0] * len(gens)
    finished: list = [None] * len(gens)
    try:
        async for i, ev in merged(gens):
            if ev.text or ev.logprobs or ev.finish_reason is not None:
                lp = None
                if gen.params.logprobs:
                    lp = _dumped(_completion_logprobs(ev.logprobs, offsets[i], ids))
                offsets[i] += len(ev.text)
                choice = {
                    "index": i,
                    "text": ev.text,
                    "logprobs": lp,
                    "finish_reason": ev.finish_reason,
                }
                yield sse({**base, "choices": [choice], **extra})
            if ev.finish_reason is not None:
                finished[i] = ev.usage
        if include_usage and all(u is not None for u in finished):
            results = [Collected(usage=u) for u in finished]
            yield sse({**base, "choices": [], "usage": usage_dict(total_usage(results))})
    except MlxdError as exc:
        yield sse(error_payload(exc))
    yield sse("[DONE]")


def _model_card(rt: Runtime, name: str, loaded: dict[str, LoadedModel]) -> ModelCard:
    lm = loaded.get(name)
    created = int(lm.loaded_at) if lm else 0
    manifest = rt.models.store.manifest(name) if not lm else None
    if manifest and manifest.get("created"):
        created = _parse_ts(manifest["created"])
    return ModelCard(id=name, created=created, owned_by="mlxd")


def _parse_ts(ts: str) -> int:
    import calendar

    try:
        return calendar.timegm(time.strptime(ts, "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError:
        return 0


@router.get("/v1/models", responses=ok(ModelList))
@router.get("/models", **ALIAS)
async def list_models(request: Request) -> Response:
    rt = runtime(request)
    loaded = {lm.name: lm for lm in await rt.models.loaded()}
    names = list(loaded)
    names += [m["name"] for m in rt.models.installed() if m["name"] not in names]
    cards = [_model_card(rt, n, loaded) for n in names]
    cards += [_adapter_card(a) for a in rt.adapters.all()]
    return json_body(ModelList(data=cards))


def _adapter_card(a: AdapterEntry) -> ModelCard:
    """A LoRA adapter as vLLM lists one: ``root`` its directory, ``parent`` its base."""
    return ModelCard(id=a.name, created=a.created, owned_by="mlxd", root=a.path, parent=a.base)


@router.get("/v1/models/{model_id:path}", responses=ok(ModelCard))
@router.get("/models/{model_id:path}", **ALIAS)
async def get_model(
    request: Request,
    model_id: Annotated[
        str, Path(description="A model name as /v1/models lists it; may contain '/' (org/name).")
    ],
) -> Response:
    rt = runtime(request)
    adapter = rt.adapters.resolve(model_id)
    if adapter is not None and adapter.name == model_id:
        return json_body(_adapter_card(adapter))
    loaded = {lm.name: lm for lm in await rt.models.loaded()}
    installed = {m["name"] for m in rt.models.installed()}
    if model_id not in set(loaded) | installed:
        raise ModelNotFound(f"The model '{model_id}' does not exist", param="model")
    return json_body(_model_card(rt, model_id, loaded))
