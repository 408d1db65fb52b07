"""The Ollama dialect, in Ollama's own JSON shapes so its official clients work unchanged.

Streaming is NDJSON (one JSON object per line) and on by default, as in Ollama. Errors are
``{"error": "..."}`` (rendered by api/errors.py for every /api/* path).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from typing import Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import Field, field_validator

from mlxd import __version__
from mlxd.api.bodies import OllamaChat, OllamaGenerate, json_body
from mlxd.api.common import runtime
from mlxd.api.docs import NDJSON, ok, streamed
from mlxd.api.reasoning import apply_reasoning
from mlxd.api.routing import ApiRoute
from mlxd.api.streaming import DisconnectAwareStream, until_disconnect
from mlxd.api.tooling import (
    apply_tools,
    arguments_dict,
    check_tool_calls,
    json_schema_constraint,
    openai_tools,
)
from mlxd.api.wire import (
    CacheSalt,
    KeepAlive,
    MinP,
    ModelName,
    Penalty,
    Priority,
    RepetitionPenalty,
    Seed,
    Temperature,
    TopP,
    WireModel,
)
from mlxd.core.errors import InvalidRequest, MlxdError
from mlxd.core.types import GenerateRequest, ImageInput, OutputConstraint, SamplingParams, Usage
from mlxd.frontend.generation import Generation

router = APIRouter(prefix="/api", route_class=ApiRoute)

OLLAMA_COMPAT_VERSION = "0.12.0"  # the Ollama API generation these shapes follow


_FAR_FUTURE = 253402300799.0  # 9999-12-31T23:59:59Z, the last second a datetime holds


def _now_iso(ts: float | None = None) -> str:
    dt = datetime.fromtimestamp(ts if ts is not None else time.time(), tz=timezone.utc)
    return dt.isoformat().replace("+00:00", "Z")


class _Body(WireModel):
    pass


class Options(_Body):
    num_predict: int | None = Field(
        None, ge=-2, description="-1: until a stop or the context is full; -2: fill the context."
    )
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: int | None = Field(None, ge=0)
    min_p: MinP | None = None
    repeat_penalty: RepetitionPenalty | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Seed | None = Field(None, description="-1 (llama.cpp's default): random, no seed.")
    stop: list[str] | None = None

    @field_validator("seed")
    @classmethod
    def _random_seed(cls, v: int | None) -> int | None:
        return None if v == -1 else v


class _GenBase(_Body):
    model: ModelName
    stream: bool = True
    options: Options | None = None
    format: Any = None
    keep_alive: KeepAlive = None
    cache_salt: CacheSalt = None  # vLLM's, as on the OpenAI routes (Ollama has none)
    priority: Priority | None = None  # top level, like keep_alive: not a model option

    def constraint(self) -> OutputConstraint | None:
        """``format``: "json" (any JSON object) or a JSON schema, enforced while decoding."""
        if self.format in (None, ""):
            return None
        if self.format == "json":
            return OutputConstraint("json_object")
        if isinstance(self.format, dict):
            return json_schema_constraint(self.format, param="format")
        raise InvalidRequest('format must be "json" or a JSON schema', param="format")

    def sampling(self) -> SamplingParams:
        o = self.options or Options()
        n = o.num_predict
        # Ollama: -1 generates until a stop or the context is full, -2 fills the context;
        # unset means the server's default_max_tokens (a safety cap Ollama lacks).
        max_tokens = None if n is None else (-1 if n < 0 else n)
        if max_tokens == 0:
            raise InvalidRequest("num_predict must not be 0", param="options.num_predict")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.8 if o.temperature is None else o.temperature,
            top_p=0.9 if o.top_p is None else o.top_p,
            top_k=40 if o.top_k is None else o.top_k,
            min_p=o.min_p or 0.0,
            repetition_penalty=o.repeat_penalty if o.repeat_penalty not in (None, 1.0) else None,
            presence_penalty=o.presence_penalty or None,
            frequency_penalty=o.frequency_penalty or None,
            seed=o.seed,
            stop=tuple(s for s in (o.stop or []) if s),
        )


class GenerateBody(_GenBase):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    raw: bool = False
    images: list[str] | None = None


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    thinking: str | None = None

    def tool_fields(self, where: str) -> dict[str, Any]:
        """An earlier turn's calls (arguments as a mapping) and a tool result's name; a
        malformed call is a 400 naming its field (``where``: this message)."""
        m: dict[str, Any] = {}
        if self.tool_calls:
            calls = check_tool_calls(self.tool_calls, f"{where}.tool_calls")
            m["tool_calls"] = [{"type": "function", "function": tc["function"]} for tc in calls]
        if self.tool_name:
            m["name"] = self.tool_name
        return m


class ChatBody(_GenBase):
    messages: list[ChatMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    think: bool | Literal["low", "medium", "high"] | None = Field(
        None, description="Thinking on or off, or a level (engine.reasoning_effort_budgets)."
    )


class ModelBody(_Body):
    model: str | None = None
    name: str | None = None  # older clients

    @property
    def target(self) -> str:
        name = self.model or self.name  # older clients send only "name"
        if not name or not name.strip():
            raise InvalidRequest("model is required", param="model")
        return name


class PullBody(ModelBody):
    stream: bool = True
    insecure: bool = False


def _ndjson(
    events: AsyncIterator[dict[str, Any]], on_close: Callable[[], None] | None = None
) -> DisconnectAwareStream:
    async def lines() -> AsyncIterator[str]:
        async for e in events:
            yield json.dumps(e, separators=(",", ":")) + "\n"

    resp = DisconnectAwareStream(lines(), media_type="application/x-ndjson")
    resp.on_close = on_close
    return resp


def _done_fields(gen: Generation, usage: Usage, reason: str | None) -> dict[str, Any]:
    if reason == "tool_calls":
        reason = "stop"  # Ollama reports a tool-calling turn as a normal stop
    return {
        "done": True,
        "done_reason": reason or "stop",
        **gen.durations_ns(),
        "prompt_eval_count": usage.prompt_tokens,
        "eval_count": usage.completion_tokens,
    }


async def _load_or_unload(request: Request, model: str, keep_alive: Any, key: str) -> dict:
    """Ollama: a request without a prompt (or messages) only loads, or with 0 unloads."""
    rt = runtime(request)
    from mlxd.core.keepalive import parse_keep_alive

    if parse_keep_alive(keep_alive) == 0:
        if await rt.models.get_loaded(model) is not None:
            await rt.models.unload(model)
        reason = "unload"
    else:
        await rt.models.touch(model, keep_alive)
        reason = "load"
    out: dict[str, Any] = {
        "model": model,
        "created_at": _now_iso(),
        "done": True,
        "done_reason": reason,
    }
    out[key] = "" if key == "response" else {"role": "assistant", "content": ""}
    return out


def _with_images(
    content: str, images: list[str] | None, where: str, out: list[ImageInput]
) -> str | list[dict]:
    """Ollama's per-message ``images`` (base64): the message's content parts, images first
    (only vision models accept them; the runtime answers 400 for the others)."""
    if not images:
        return content
    out.extend(ImageInput(src, f"{where}[{j}]") for j, src in enumerate(images))
    return [*({"type": "image"} for _ in images), {"type": "text", "text": content}]


@router.post(
    "/generate",
    responses=ok(
        OllamaGenerate, (NDJSON, "response parts, the last with done: true (the default)")
    ),
)
async def generate(body: GenerateBody, request: Request) -> Response | dict[str, Any]:
    if body.suffix:
        raise InvalidRequest("suffix (fill-in-the-middle) is not supported", param="suffix")
    params = body.sampling()
    if not body.prompt:
        return await _load_or_unload(request, body.model, body.keep_alive, "response")
    images: list[ImageInput] = []
    if body.raw:
        if body.images:
            raise InvalidRequest("a raw prompt cannot carry images", param="images")
        req = GenerateRequest(model=body.model, sampling=params, prompt=body.prompt)
    else:
        msgs: list[dict[str, Any]] = (
            [{"role": "system", "content": body.system}] if body.system else []
        )
        msgs.append(
            {"role": "user", "content": _with_images(body.prompt, body.images, "images", images)}
        )
        req = GenerateRequest(
            model=body.model, sampling=params, messages=msgs, images=images or None
        )
    req.keep_alive, req.request_id = body.keep_alive, request.state.request_id
    req.cache_salt, req.priority = body.cache_salt, body.priority
    req.constraint = body.constraint()
    gen = await until_disconnect(request, runtime(request).submit(req))

    def part(text: str, thinking: str = "", calls: list | None = None) -> dict:
        out = {"model": gen.model, "created_at": _now_iso(), "response": text, "done": False}
        if thinking:
            out["thinking"] = thinking
        return out

    def last(usage: Usage, reason: str | None) -> dict:
        return {**part(""), **_done_fields(gen, usage, reason), "context": []}

    return await _respond(request, gen, body.stream, part, last, "response")


@router.post(
    "/chat",
    responses=ok(OllamaChat, (NDJSON, "message parts, the last with done: true (the default)")),
)
async def chat(body: ChatBody, request: Request) -> Response | dict[str, Any]:
    params = body.sampling()
    if not body.messages:
        return await _load_or_unload(request, body.model, body.keep_alive, "message")
    images: list[ImageInput] = []
    req = GenerateRequest(
        model=body.model,
        sampling=params,
        messages=[
            {
                "role": m.role,
                "content": _with_images(m.content, m.images, f"messages[{i}].images", images),
                **m.tool_fields(f"messages[{i}]"),
            }
            for i, m in enumerate(body.messages)
        ],
        keep_alive=body.keep_alive,
        request_id=request.state.request_id,
        images=images or None,
        cache_salt=body.cache_salt,
        priority=body.priority,
    )
    req.constraint = body.constraint()
    tools = openai_tools(body.tools)
    apply_tools(req, tools, ("auto", None), None)
    if isinstance(body.think, bool):
        req.template_kwargs = {"enable_thinking": body.think}
    elif body.think is not None:
        req.template_kwargs = {"enable_thinking": True}
        apply_reasoning(req, runtime(request).settings, effort=body.think)
    gen = await until_disconnect(request, runtime(request).submit(req))

    def part(text: str, thinking: str = "", calls: list | None = None) -> dict:
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            msg["thinking"] = thinking
        if calls:
            msg["tool_calls"] = [
                {"function": {"name": c.name, "arguments": arguments_dict(c)}} for c in calls
            ]
        return {"model": gen.model, "created_at": _now_iso(), "message": msg, "done": False}

    def last(usage: Usage, reason: str | None) -> dict:
        return {**part(""), **_done_fields(gen, usage, reason)}

    return await _respond(request, gen, body.stream, part, last, "message")


async def _respond(
    request: Request,
    gen: Generation,
    stream: bool,
    part: Callable[..., dict[str, Any]],
    last: Callable[[Usage, str | None], dict[str, Any]],
    key: str,
) -> Response:
    if stream:

        async def events() -> AsyncIterator[dict]:
            try:
                async for ev in gen:
                    if ev.reasoning or ev.tool_calls:
                        yield part(ev.text, ev.reasoning, ev.tool_calls)
                    elif ev.text:
                        yield part(ev.text)
                    if ev.finish_reason is not None:
                        yield last(ev.usage or Usage(), ev.finish_reason)
            except MlxdError as exc:
                yield {"error": exc.message}

        return _ndjson(events(), gen.close)

    async def collect() -> dict:
        texts, thinking, calls, usage, reason = [], [], [], Usage(), None
        async for ev in gen:
            texts.append(ev.text)
            thinking.append(ev.reasoning)
            calls.extend(ev.tool_calls)
            if ev.finish_reason is not None:
                usage, reason = ev.usage or usage, ev.finish_reason
        out = last(usage, reason)
        if key == "response":
            out["response"] = "".join(texts)
            if any(thinking):
                out["thinking"] = "".join(thinking)
        else:
            out["message"] = {
                **out["message"],
                **part("".join(texts), "".join(thinking), calls)["message"],
            }
        return out

    body = await until_disconnect(request, collect())
    # the parts are shared with the stream: the whole body is checked against its model here
    return json_body((OllamaGenerate if key == "response" else OllamaChat).model_validate(body))


def _details(manifest: dict, config: dict | None = None) -> dict[str, Any]:
    config = config or {}
    q = manifest.get("quantization") or config.get("quantization")
    quant = (
        f"Q{q.get('bits')}"
        if isinstance(q, dict) and q.get("bits")
        else ((manifest.get("dtype") or config.get("torch_dtype") or "").upper() or "unknown")
    )
    family = config.get("model_type") or manifest.get("model_type") or ""
    return {
        "parent_model": "",
        "format": manifest.get("format") or "mlx",
        "family": family,
        "families": [family] if family else None,
        "parameter_size": _param_size(manifest, config),
        "quantization_level": quant,
    }


def _param_size(manifest: dict, config: dict) -> str:
    n = manifest.get("num_parameters")
    if not n:
        return ""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": OLLAMA_COMPAT_VERSION, "mlxd_version": __version__}


@router.get("/tags")
async def tags(request: Request) -> dict[str, Any]:
    rt = runtime(request)
    models = []
    for m in rt.models.installed():
        models.append(
            {
                "name": m["name"],
                "model": m["name"],
                "modified_at": m.get("created") or _now_iso(0),
                "size": m.get("size") or 0,
                "digest": (m.get("digest") or "").removeprefix("sha256:"),
                "details": _details(m),
            }
        )
    return {"models": models}


@router.post("/show")
async def show(body: ModelBody, request: Request) -> dict[str, Any]:
    info = runtime(request).catalog_ops.describe(body.target)
    m, cfg = info["manifest"], info["config"]
    model_info = {
        f"{cfg.get('model_type', 'general')}.{k}": v
        for k, v in cfg.items()
        if isinstance(v, (int, float, str, bool))
    }
    model_info["general.architecture"] = cfg.get("model_type", "")
    caps = (
        ["completion"] if m.get("kind", "chat") in ("chat", "vision") else [m.get("kind", "chat")]
    )
    if m.get("kind") == "vision":
        caps.append("vision")
    return {
        "modelfile": f"# mlxd model {info['name']}\nFROM {m.get('source', info['path'])}\n",
        "parameters": "",
        "template": info["chat_template"],
        "details": _details(m, cfg),
        "model_info": model_info,
        "capabilities": caps,
        "modified_at": m.get("created") or _now_iso(0),
    }


@router.post("/pull", responses={200: streamed(NDJSON, "progress objects (the default)")})
async def pull(body: PullBody, request: Request) -> Response | dict[str, Any]:
    rt = runtime(request)
    name = body.target
    if not body.stream:
        await rt.catalog_ops.pull(name)
        return {"status": "success"}

    queue: asyncio.Queue = asyncio.Queue()
    task = asyncio.ensure_future(rt.catalog_ops.pull(name, progress=queue.put_nowait))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    # The stream starts at the pull's second event: a pull that fails before it (a bad
    # name, a missing repository, a hub switched off or out of reach) answers with its
    # error's status; later failures are the stream's last line, as in Ollama.
    held: list[dict] = []
    ended = False
    while len(held) < 2 and not ended:
        item = await queue.get()
        ended = item is None
        if item is not None:
            held.append(item)
    if ended and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]

    async def events() -> AsyncIterator[dict]:
        for item in held:
            yield item
        while not ended:
            item = await queue.get()
            if item is None:
                break
            yield item
        try:
            task.result()
        except MlxdError as exc:
            yield {"error": exc.message}
        except Exception as exc:  # noqa: BLE001 - reported in the stream, as Ollama does
            yield {"error": f"pull failed: {exc}"}

    return _ndjson(events())


@router.delete("/delete")
async def delete(body: ModelBody, request: Request) -> Response:
    await runtime(request).catalog_ops.delete(body.target)
    return JSONResponse({})


@router.get("/ps")
async def ps(request: Request) -> dict[str, Any]:
    rt = runtime(request)
    out = []
    for lm in await rt.models.loaded():
        manifest = rt.models.store.manifest(lm.name) or {"format": "mlx"}
        expires = lm.expires_at if lm.expires_at is not None else _FAR_FUTURE
        out.append(
            {
                "name": lm.name,
                "model": lm.name,
                "size": lm.size,
                "digest": (manifest.get("digest") or "").removeprefix("sha256:"),
                "details": _details(manifest, lm.config),
                # Ollama reports far-future times for "forever" and for busy models
                # and for a keep_alive so long (1e300 s, "9999999999h") that the date is past
                # what a datetime holds: that was a 500 OverflowError (tests/ops/test_fuzz.py)
                "expires_at": _now_iso(min(expires, _FAR_FUTURE)),
                "size_vram": lm.size if rt.backend != "cpu" else 0,
                "context_length": lm.context_length,
                "engine_cores": lm.stats.get("engine_cores", []),  # mlxd: the cores holding it
            }
        )
    # mlxd's addition (Ollama clients ignore it): every engine core, one per device
    status = await rt.status()
    return {"models": out, "engine_cores": status["engine_cores"]}
