"""The OpenAI dialect: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from mlxd.api.common import collect, new_id, now, runtime, usage_dict
from mlxd.api.errors import error_payload
from mlxd.api.schemas import ChatCompletionRequest, CompletionRequest
from mlxd.api.streaming import sse, sse_response, until_disconnect
from mlxd.core.errors import MlxdError, ModelNotFound
from mlxd.core.types import GenerateRequest, TokenLogprob
from mlxd.runtime.service import Generation

router = APIRouter()


def _chat_logprobs(items: list[TokenLogprob]) -> dict:
    return {
        "content": [
            {
                "token": lp.token,
                "logprob": lp.logprob,
                "bytes": list(lp.token.encode()),
                "top_logprobs": [
                    {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode())}
                    for t in lp.top
                ],
            }
            for lp in items
        ]
    }


def _completion_logprobs(items: list[TokenLogprob], offset: int = 0) -> dict:
    offsets, pos = [], offset
    for lp in items:
        offsets.append(pos)
        pos += len(lp.token)
    return {
        "tokens": [lp.token for lp in items],
        "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in items],
        "text_offset": offsets,
    }


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    req = GenerateRequest(
        model=body.model,
        sampling=body.to_sampling(),
        messages=body.template_messages(),
        request_id=request.state.request_id,
        keep_alive=body.keep_alive,
    )
    gen = await until_disconnect(request, runtime(request).submit(req))
    cid, created = new_id("chatcmpl"), now()
    if body.stream:
        return sse_response(_chat_stream(gen, cid, created, body.include_usage), gen.close)
    res = await until_disconnect(request, collect(gen))
    return JSONResponse({
        "id": cid,
        "object": "chat.completion",
        "created": created,
        "model": gen.model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": res.text},
            "logprobs": _chat_logprobs(res.logprobs) if gen.params.logprobs else None,
            "finish_reason": res.finish_reason,
        }],
        "usage": usage_dict(res.usage),
    })


async def _chat_stream(gen: Generation, cid: str, created: int, include_usage: bool
                       ) -> AsyncIterator[str]:
    base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": gen.model}
    extra = {"usage": None} if include_usage else {}

    def chunk(delta: dict, finish: str | None = None, logprobs: dict | None = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse({**base, "choices": [choice], **extra})

    # The per-token chunk differs only in its text: frame it around one json.dumps of the
    # delta instead of building and serialising the whole object for every token.
    head, _, tail = chunk({"content": "\x00"}).partition('"\\u0000"')
    want_logprobs = gen.params.logprobs

    yield chunk({"role": "assistant", "content": ""})
    try:
        async for ev in gen:
            if want_logprobs and (ev.text or ev.logprobs):
                yield chunk({"content": ev.text}, None, _chat_logprobs(ev.logprobs))
            elif ev.text:
                yield head + json.dumps(ev.text) + tail
            if ev.finish_reason is not None:
                yield chunk({}, ev.finish_reason)
                if include_usage and ev.usage is not None:
                    yield sse({**base, "choices": [], "usage": usage_dict(ev.usage)})
    except MlxdError as exc:
        yield sse(error_payload(exc))
    yield sse("[DONE]")


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    text, tokens = body.single_prompt()
    req = GenerateRequest(
        model=body.model,
        sampling=body.to_sampling(),
        prompt=text,
        prompt_tokens=tokens,
        request_id=request.state.request_id,
        keep_alive=body.keep_alive,
    )
    gen = await until_disconnect(request, runtime(request).submit(req))
    cid, created = new_id("cmpl"), now()
    if body.stream:
        return sse_response(
            _completion_stream(gen, cid, created, body.include_usage), gen.close
        )
    res = await until_disconnect(request, collect(gen))
    return JSONResponse({
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": gen.model,
        "choices": [{
            "index": 0,
            "text": res.text,
            "logprobs": _completion_logprobs(res.logprobs) if gen.params.logprobs else None,
            "finish_reason": res.finish_reason,
        }],
        "usage": usage_dict(res.usage),
    })


async def _completion_stream(gen: Generation, cid: str, created: int, include_usage: bool
                             ) -> AsyncIterator[str]:
    base = {"id": cid, "object": "text_completion", "created": created, "model": gen.model}
    extra = {"usage": None} if include_usage else {}
    offset = 0
    try:
        async for ev in gen:
            if ev.text or ev.logprobs or ev.finish_reason is not None:
                lp = None
                if gen.params.logprobs:
                    lp = _completion_logprobs(ev.logprobs, offset)
                offset += len(ev.text)
                choice = {"index": 0, "text": ev.text, "logprobs": lp,
                          "finish_reason": ev.finish_reason}
                yield sse({**base, "choices": [choice], **extra})
            if ev.finish_reason is not None and include_usage and ev.usage is not None:
                yield sse({**base, "choices": [], "usage": usage_dict(ev.usage)})
    except MlxdError as exc:
        yield sse(error_payload(exc))
    yield sse("[DONE]")


def _model_card(rt, name: str) -> dict:
    lm = rt.models.get_loaded(name)
    created = int(lm.loaded_at) if lm else 0
    manifest = rt.models.store.manifest(name) if not lm else None
    if manifest and manifest.get("created"):
        created = _parse_ts(manifest["created"])
    return {"id": name, "object": "model", "created": created, "owned_by": "mlxd"}


def _parse_ts(ts: str) -> int:
    import calendar

    try:
        return calendar.timegm(time.strptime(ts, "%Y-%m-%dT%H:%M:%SZ"))
    except ValueError:
        return 0


@router.get("/v1/models")
async def list_models(request: Request):
    rt = runtime(request)
    names = [lm.name for lm in rt.models.loaded()]
    names += [m["name"] for m in rt.models.installed() if m["name"] not in names]
    return {"object": "list", "data": [_model_card(rt, n) for n in names]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    rt = runtime(request)
    loaded = {lm.name for lm in rt.models.loaded()}
    installed = {m["name"] for m in rt.models.installed()}
    if model_id not in loaded | installed:
        raise ModelNotFound(f"The model '{model_id}' does not exist", param="model")
    return _model_card(rt, model_id)
