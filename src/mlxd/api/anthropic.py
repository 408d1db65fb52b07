"""The Anthropic dialect: POST /v1/messages and /v1/messages/count_tokens.

Responses and the streaming event sequence follow Anthropic's Messages API, so the official
``anthropic`` client works against this server: ``message_start``, then per content block
(thinking, text, tool_use) ``content_block_start`` / ``content_block_delta`` (text_delta,
thinking_delta, input_json_delta) / ``content_block_stop`` (a ``ping`` after the first
start), then ``message_delta`` (stop_reason, usage) and ``message_stop``. Errors are
``{"type": "error", "error": {"type", "message"}}`` (api/errors.py renders them for every
/v1/messages* path). ``usage.cache_read_input_tokens`` counts prompt tokens served from the
prefix cache; ``input_tokens`` the rest, as Anthropic counts them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response

from mlxd.api.anthropic_schemas import CountTokensRequest, MessagesRequest
from mlxd.api.bodies import (
    AnthropicResponse,
    AnthropicUsage,
    TextBlock,
    ThinkingBlock,
    TokenCountAnthropic,
    ToolUseBlock,
    json_body,
)
from mlxd.api.common import collect, runtime, submit_n
from mlxd.api.docs import SSE, ok
from mlxd.api.errors import anthropic_error_body
from mlxd.api.routing import ApiRoute
from mlxd.api.streaming import sse_response, until_disconnect
from mlxd.api.tooling import apply_tools, arguments_dict, openai_response_format
from mlxd.core.errors import MlxdError
from mlxd.core.types import GenerateRequest, ImageInput, SamplingParams, ToolCall, Usage
from mlxd.frontend.generation import Generation
from mlxd.observability.context import note_first

router = APIRouter(route_class=ApiRoute)


def _request(
    body: MessagesRequest | CountTokensRequest, request: Request, sampling: Any
) -> GenerateRequest:
    images: list[ImageInput] = []
    req = GenerateRequest(
        model=body.model,
        sampling=sampling,
        messages=body.template_messages(images),
        request_id=request.state.request_id,
        keep_alive=body.keep_alive,
    )
    req.images = images or None  # vision models take them; the runtime 400s for the others
    tools = body.openai_tools()
    choice, parallel = body.choice(tools)
    apply_tools(req, tools, choice, parallel)
    req.template_kwargs = body.template_kwargs()
    req.thinking_budget = body.thinking_budget()
    req.constraint = openai_response_format(
        (body.output_config or {}).get("format"), param="output_config.format"
    )
    return req


def _stop_reason(finish: str | None, stop_sequence: str | None) -> str:
    if finish == "tool_calls":
        return "tool_use"
    if finish == "length":
        return "max_tokens"
    if stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def _usage_body(u: Usage) -> AnthropicUsage:
    return AnthropicUsage(
        input_tokens=u.prompt_tokens - u.cached_tokens,
        cache_creation_input_tokens=0,
        cache_read_input_tokens=u.cached_tokens,
        output_tokens=u.completion_tokens,
    )


def _usage(u: Usage) -> dict[str, int]:
    """:func:`_usage_body` for a hand-framed streamed event."""
    return _usage_body(u).model_dump(exclude_unset=True)


def _tool_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def _tool_block(call: ToolCall) -> ToolUseBlock:
    return ToolUseBlock(id=_tool_id(call), name=call.name, input=arguments_dict(call))


@router.post(
    "/v1/messages",
    responses=ok(
        AnthropicResponse,
        (SSE, "message_start, content_block_start/delta/stop, message_delta, message_stop"),
    ),
)
async def messages(body: MessagesRequest, request: Request) -> Response:
    req = _request(body, request, body.sampling())
    req.user, req.cache_salt, req.priority = body.user, body.cache_salt, body.priority
    (gen,) = await submit_n(request, req, 1)
    mid = "msg_" + uuid.uuid4().hex[:24]
    note_first(response_id=mid)
    if body.stream:
        return sse_response(_stream(gen, mid), gen.close)
    res = await until_disconnect(request, collect(gen))
    content: list[ThinkingBlock | TextBlock | ToolUseBlock] = []
    if res.reasoning:
        content.append(ThinkingBlock(thinking=res.reasoning, signature=""))
    if res.text or not res.tool_calls:
        content.append(TextBlock(text=res.text))
    content.extend(_tool_block(c) for c in res.tool_calls)
    return json_body(
        AnthropicResponse(
            id=mid,
            model=gen.model,
            content=content,
            stop_reason=_stop_reason(res.finish_reason, res.stop_sequence),
            stop_sequence=res.stop_sequence,
            usage=_usage_body(res.usage),
        )
    )


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


async def _stream(gen: Generation, mid: str) -> AsyncIterator[str]:
    n_prompt = len(gen.prompt_tokens)
    yield _event(
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": mid,
                "type": "message",
                "role": "assistant",
                "model": gen.model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {
                    "input_tokens": n_prompt,
                    "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": 0,
                    "output_tokens": 0,
                },
            },
        },
    )
    index = -1
    open_kind: str | None = None
    pinged = False

    def start(kind: str, block: dict[str, Any]) -> list[str]:
        nonlocal index, open_kind, pinged
        out = stop()
        index += 1
        open_kind = kind
        out.append(
            _event(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": block},
            )
        )
        if not pinged:
            pinged = True
            out.append(_event("ping", {"type": "ping"}))
        return out

    def stop() -> list[str]:
        nonlocal open_kind
        if open_kind is None:
            return []
        open_kind = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": index})]

    def delta(d: dict[str, Any]) -> str:
        return _event(
            "content_block_delta", {"type": "content_block_delta", "index": index, "delta": d}
        )

    try:
        async for ev in gen:
            if ev.reasoning:
                if open_kind != "thinking":
                    for e in start(
                        "thinking", {"type": "thinking", "thinking": "", "signature": ""}
                    ):
                        yield e
                yield delta({"type": "thinking_delta", "thinking": ev.reasoning})
            if ev.text:
                if open_kind != "text":
                    for e in start("text", {"type": "text", "text": ""}):
                        yield e
                yield delta({"type": "text_delta", "text": ev.text})
            for call in ev.tool_calls:
                for e in start(
                    "tool_use",
                    {"type": "tool_use", "id": _tool_id(call), "name": call.name, "input": {}},
                ):
                    yield e
                yield delta(
                    {
                        "type": "input_json_delta",
                        "partial_json": json.dumps(arguments_dict(call), ensure_ascii=False),
                    }
                )
                for e in stop():
                    yield e
            if ev.finish_reason is not None:
                if index == -1:  # nothing at all came out: one empty text block
                    for e in start("text", {"type": "text", "text": ""}):
                        yield e
                for e in stop():
                    yield e
                usage = _usage(ev.usage or Usage(prompt_tokens=n_prompt))
                yield _event(
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {
                            "stop_reason": _stop_reason(ev.finish_reason, ev.stop_sequence),
                            "stop_sequence": ev.stop_sequence,
                        },
                        "usage": usage,
                    },
                )
                yield _event("message_stop", {"type": "message_stop"})
    except MlxdError as exc:
        yield _event("error", anthropic_error_body(exc.status, exc.message))


@router.post("/v1/messages/count_tokens", responses=ok(TokenCountAnthropic))
async def count_tokens(body: CountTokensRequest, request: Request) -> Response:
    req = _request(body, request, SamplingParams())
    _, n = await until_disconnect(request, runtime(request).count_tokens(req))
    return json_body(TokenCountAnthropic(input_tokens=n))
