"""The OpenAI Responses dialect: POST /v1/responses, GET and DELETE /v1/responses/{id}.

``input`` is a string or a list of items (messages with text parts, ``function_call`` and
``function_call_output`` items); ``instructions`` is the system prompt (not carried over by
``previous_response_id``, as in OpenAI's API); function tools come back as
``function_call`` output items, thinking as a ``reasoning`` item; ``text.format`` takes
the same structured-output formats as Chat Completions' ``response_format``. Streaming
sends the typed events the ``openai`` client's ``responses.create(stream=True)`` expects
(``response.created``, ``response.output_item.added``, ``response.output_text.delta``...,
``response.completed``).

Stored responses (``store``, on by default) live in a bounded in-memory LRU
(``server.responses_store_size``): enough for ``previous_response_id`` chains and
GET/DELETE, lost on restart. Each belongs to the API key that created it (api/owner.py):
for any other key, GET, DELETE and ``previous_response_id`` answer 404 as for a missing id.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import Field

from mlxd.api.common import Collected, collect, runtime, submit_n
from mlxd.api.docs import SSE, streamed
from mlxd.api.owner import Principal, principal
from mlxd.api.routing import ApiRoute, RouteOptions
from mlxd.api.streaming import sse_response, until_disconnect
from mlxd.api.tooling import (
    apply_tools,
    check_call,
    function_tool,
    openai_response_format,
    openai_tool_choice,
)
from mlxd.api.wire import (
    CacheSalt,
    KeepAlive,
    MaxTokens,
    ModelName,
    Priority,
    Temperature,
    TopP,
    WireModel,
)
from mlxd.config import EFFORT_BUDGETS
from mlxd.core.errors import InvalidRequest, MlxdError
from mlxd.core.types import GenerateRequest, ImageInput, SamplingParams, Usage
from mlxd.frontend.generation import Generation
from mlxd.observability.context import note_first

router = APIRouter(route_class=ApiRoute)
# mlx-vlm's paths, without /v1 (see api/openai.py)
ALIAS: RouteOptions = {"include_in_schema": False}


class ResponseNotFound(MlxdError):
    status = 404
    code = "not_found"
    type = "invalid_request_error"


class ResponsesRequest(WireModel):
    NULL_IS_DEFAULT = frozenset({"stream", "store"})  # nullable in OpenAI's reference

    model: ModelName = "default"
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = Field(None, le=2.0)
    top_p: TopP | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    keep_alive: KeepAlive = None
    cache_salt: CacheSalt = None
    priority: Priority | None = None

    def function_tools(self) -> list[dict] | None:
        if not self.tools:
            return None
        out = []
        for i, t in enumerate(self.tools):
            if t.get("type") != "function":
                raise InvalidRequest(
                    f"tools[{i}]: only function tools are supported", param=f"tools[{i}]"
                )
            inner = t.get("function")
            fn: dict[str, Any] = inner if isinstance(inner, dict) else t
            out.append(
                function_tool(
                    fn.get("name"), fn.get("description"), fn.get("parameters"), param=f"tools[{i}]"
                )
            )
        return out


class ResponseStore:
    """id -> (owner, response object, the conversation so far without instructions); LRU.

    Another owner's response is missing to the caller: the same 404, and its place in the
    LRU order is left alone."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[str, tuple[str, dict, list[dict]]] = OrderedDict()

    def put(self, who: Principal, response: dict, history: list[dict]) -> None:
        if self.size <= 0:
            return
        self._items[response["id"]] = (who.owner, response, history)
        self._items.move_to_end(response["id"])
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def get(self, who: Principal, rid: str) -> tuple[dict, list[dict]]:
        item = self._items.get(rid)
        if item is None or not who.owns(item[0]):
            raise ResponseNotFound(
                f"Response with id '{rid}' not found.", param="previous_response_id"
            )
        self._items.move_to_end(rid)
        return item[1], item[2]

    def delete(self, who: Principal, rid: str) -> None:
        item = self._items.get(rid)
        if item is None or not who.owns(item[0]):
            raise ResponseNotFound(f"Response with id '{rid}' not found.")
        del self._items[rid]


def _store(request: Request) -> ResponseStore:
    state = request.app.state
    store = getattr(state, "responses_store", None)
    if store is None:
        size = state.settings.server.responses_store_size
        store = state.responses_store = ResponseStore(size)
    return store


# -- input items -> chat-template messages ----------------------------------------------------


def _content_text(
    content: Any, where: str, images: list[ImageInput] | None = None
) -> str | list[dict]:
    """Text, or (with images) the parts in order: text and ``{"type": "image"}``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest("content must be a string or a list of parts", param=where)
    parts: list[dict] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind in ("input_image", "image_url") and images is not None:
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url:
                raise InvalidRequest(
                    "an input_image needs an image_url (a data: URL or an http(s) URL)",
                    param=f"{where}[{j}]",
                )
            images.append(ImageInput(url, f"{where}[{j}]"))
            parts.append({"type": "image"})
        elif kind in ("input_image", "image_url", "input_file"):
            raise InvalidRequest("this model does not accept images or files", param=where)
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(part.get("refusal", ""))})
        else:
            raise InvalidRequest(f"unsupported content part type '{kind}'", param=where)
    if any(p["type"] == "image" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def input_messages(inp: str | list[dict], images: list[ImageInput] | None = None) -> list[dict]:
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    out: list[dict] = []
    for i, item in enumerate(inp):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequest(f"unknown role '{role}'", param=f"{where}.role")
            out.append(
                {
                    "role": "system" if role == "developer" else role,
                    "content": _content_text(
                        item.get("content"), f"{where}.content", images if role == "user" else None
                    ),
                }
            )
        elif kind == "function_call":
            call_id = item.get("call_id") or item.get("id") or ""
            if not isinstance(call_id, str):
                raise InvalidRequest(f"{where}.call_id must be a string", param=f"{where}.call_id")
            call = {
                "id": call_id,
                "type": "function",
                "function": check_call(item.get("name"), item.get("arguments") or "{}", where),
            }
            last = out[-1] if out else None
            if (
                last is not None
                and last["role"] == "assistant"
                and (last.get("tool_calls") or not last.get("content"))
            ):
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": item.get("call_id", ""),
                    "content": output
                    if isinstance(output, str)
                    else _content_text(output, f"{where}.output"),
                }
            )
        elif kind == "reasoning":
            continue
        else:
            raise InvalidRequest(f"unsupported input item type '{kind}'", param=where)
    return out


# -- output items --------------------------------------------------------------------------------


def _ids() -> str:
    return uuid.uuid4().hex[:24]


def _usage(u: Usage) -> dict:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.total_tokens,
    }


def _message_item(mid: str, text: str, status: str = "completed") -> dict:
    return {
        "type": "message",
        "id": mid,
        "status": status,
        "role": "assistant",
        "content": [_text_part(text)] if status == "completed" else [],
    }


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(rid: str, text: str) -> dict:
    return {
        "type": "reasoning",
        "id": rid,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _call_item(call: Any, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": "fc_" + call.id.removeprefix("call_"),
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if status == "completed" else "",
        "status": status,
    }


def _output(res: Collected) -> list[dict]:
    items = []
    if res.reasoning:
        items.append(_reasoning_item("rs_" + _ids(), res.reasoning))
    if res.text or not res.tool_calls:
        items.append(_message_item("msg_" + _ids(), res.text))
    items.extend(_call_item(c) for c in res.tool_calls)
    return items


def _history_after(messages: list[dict], res: Collected) -> list[dict]:
    """The conversation to store: images are not kept (only their turn sees them)."""
    messages = [
        {**m, "content": "".join(p.get("text", "") for p in m["content"])}
        if isinstance(m.get("content"), list)
        else m
        for m in messages
    ]
    msg: dict[str, Any] = {"role": "assistant", "content": res.text}
    if res.tool_calls:
        msg["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in res.tool_calls
        ]
    return [*messages, msg]


class _Turn:
    """One request's translation, kept for building and storing the response."""

    def __init__(self, body: ResponsesRequest, request: Request) -> None:
        self.body = body
        self.id = "resp_" + _ids()
        note_first(response_id=self.id)
        self.created = int(time.time())
        history: list[dict] = []
        if body.previous_response_id:
            _, history = _store(request).get(principal(request), body.previous_response_id)
        images: list[ImageInput] = []
        self.history = [*history, *input_messages(body.input, images)]
        messages = list(self.history)
        if body.instructions:
            messages.insert(0, {"role": "system", "content": body.instructions})
        self.req = GenerateRequest(
            model=body.model,
            sampling=SamplingParams(
                max_tokens=body.max_output_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
            ),
            messages=messages,
            request_id=request.state.request_id,
            keep_alive=body.keep_alive,
            user=body.user,
            cache_salt=body.cache_salt,
            priority=body.priority,
        )
        # images of this turn only (earlier turns' images are not resent to the model)
        self.req.images = images or None
        tools = body.function_tools()
        apply_tools(
            self.req, tools, openai_tool_choice(body.tool_choice, tools), body.parallel_tool_calls
        )
        fmt = (body.text or {}).get("format")
        self.req.constraint = openai_response_format(fmt, param="text.format")
        effort = (body.reasoning or {}).get("effort")
        if effort is not None:
            if effort not in EFFORT_BUDGETS:
                raise InvalidRequest(
                    f"reasoning.effort must be one of {', '.join(EFFORT_BUDGETS)}",
                    param="reasoning.effort",
                )
            self.req.template_kwargs = {"enable_thinking": effort not in ("none", "minimal")}
            budgets = runtime(request).settings.engine.reasoning_effort_budgets
            self.req.thinking_budget = budgets.get(effort)

    def response(
        self,
        model: str,
        status: str,
        output: list[dict],
        usage: Usage | None,
        finish: str | None = None,
    ) -> dict:
        b = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": model,
            "output": output,
            "parallel_tool_calls": True if b.parallel_tool_calls is None else b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": (b.reasoning or {}).get("effort"), "summary": None},
            "store": b.store,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "text": b.text or {"format": {"type": "text"}},
            "tool_choice": b.tool_choice or "auto",
            "tools": b.tools or [],
            "truncation": "disabled",
            "user": b.user,
            "metadata": b.metadata or {},
            "usage": _usage(usage) if usage is not None else None,
        }


@router.post(
    "/v1/responses",
    responses={
        200: streamed(SSE, "response.created ... response.output_text.delta ... response.completed")
    },
)
@router.post("/responses", **ALIAS)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    turn = _Turn(body, request)
    (gen,) = await submit_n(request, turn.req, 1)
    store = _store(request)
    if body.stream:
        return sse_response(_stream(turn, gen, store, principal(request)), gen.close)
    res = await until_disconnect(request, collect(gen))
    status = "incomplete" if res.finish_reason == "length" else "completed"
    obj = turn.response(gen.model, status, _output(res), res.usage, res.finish_reason)
    if body.store:
        store.put(principal(request), obj, _history_after(turn.history, res))
    return JSONResponse(obj)


async def _stream(
    turn: _Turn, gen: Generation, store: ResponseStore, who: Principal
) -> AsyncIterator[str]:
    seq = 0

    def event(kind: str, **data: Any) -> str:
        nonlocal seq
        payload = {"type": kind, "sequence_number": seq, **data}
        seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    obj = turn.response(gen.model, "in_progress", [], None)
    yield event("response.created", response=obj)
    yield event("response.in_progress", response=obj)
    output: list[dict] = []
    res = Collected()
    texts: list[str] = []
    thinking: list[str] = []
    open_kind: str | None = None  # "message" | "reasoning"
    item: dict = {}

    def close() -> list[str]:
        nonlocal open_kind
        out: list[str] = []
        idx = len(output)
        if open_kind == "message":
            text = "".join(texts)
            out.append(
                event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
            )
            out.append(
                event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    part=_text_part(text),
                )
            )
            done = _message_item(item["id"], text)
        elif open_kind == "reasoning":
            text = "".join(thinking)
            out.append(
                event(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    text=text,
                )
            )
            done = _reasoning_item(item["id"], text)
        else:
            return out
        out.append(event("response.output_item.done", output_index=idx, item=done))
        output.append(done)
        open_kind = None
        return out

    def open_(kind: str) -> list[str]:
        nonlocal open_kind, item
        out = close()
        idx = len(output)
        if kind == "message":
            item = _message_item("msg_" + _ids(), "", status="in_progress")
            texts.clear()
            out.append(event("response.output_item.added", output_index=idx, item=item))
            out.append(
                event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    part=_text_part(""),
                )
            )
        else:
            item = {"type": "reasoning", "id": "rs_" + _ids(), "summary": []}
            thinking.clear()
            out.append(event("response.output_item.added", output_index=idx, item=item))
        open_kind = kind
        return out

    try:
        async for ev in gen:
            if ev.reasoning:
                if open_kind != "reasoning":
                    for e in open_("reasoning"):
                        yield e
                thinking.append(ev.reasoning)
                res.reasoning += ev.reasoning
                yield event(
                    "response.reasoning_text.delta",
                    item_id=item["id"],
                    output_index=len(output),
                    content_index=0,
                    delta=ev.reasoning,
                )
            if ev.text:
                if open_kind != "message":
                    for e in open_("message"):
                        yield e
                texts.append(ev.text)
                res.text += ev.text
                yield event(
                    "response.output_text.delta",
                    item_id=item["id"],
                    output_index=len(output),
                    content_index=0,
                    delta=ev.text,
                    logprobs=[],
                )
            for call in ev.tool_calls:
                for e in close():
                    yield e
                idx = len(output)
                added = _call_item(call, status="in_progress")
                yield event("response.output_item.added", output_index=idx, item=added)
                yield event(
                    "response.function_call_arguments.delta",
                    item_id=added["id"],
                    output_index=idx,
                    delta=call.arguments,
                )
                yield event(
                    "response.function_call_arguments.done",
                    item_id=added["id"],
                    output_index=idx,
                    arguments=call.arguments,
                    name=call.name,
                )
                done = _call_item(call)
                yield event("response.output_item.done", output_index=idx, item=done)
                output.append(done)
                res.tool_calls.append(call)
            if ev.finish_reason is not None:
                if not output and open_kind is None:  # nothing came out: an empty message
                    for e in open_("message"):
                        yield e
                for e in close():
                    yield e
                res.finish_reason, res.usage = ev.finish_reason, ev.usage or Usage()
                status = "incomplete" if ev.finish_reason == "length" else "completed"
                final = turn.response(gen.model, status, output, res.usage, ev.finish_reason)
                if turn.body.store:
                    store.put(who, final, _history_after(turn.history, res))
                kind = "response.incomplete" if status == "incomplete" else "response.completed"
                yield event(kind, response=final)
    except MlxdError as exc:
        yield event("error", code=exc.code, message=exc.message, param=exc.param)


@router.get("/v1/responses/{response_id}")
@router.get("/responses/{response_id}", **ALIAS)
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    obj, _ = _store(request).get(principal(request), response_id)
    return obj


@router.delete("/v1/responses/{response_id}")
@router.delete("/responses/{response_id}", **ALIAS)
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    _store(request).delete(principal(request), response_id)
    return {"id": response_id, "object": "response", "deleted": True}
