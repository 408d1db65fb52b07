"""Small helpers the dialect routers share."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request

from mlxd.api import bodies
from mlxd.api.streaming import until_disconnect
from mlxd.core.types import GenerateRequest, TokenEvent, TokenLogprob, ToolCall, Usage
from mlxd.frontend.generation import Generation
from mlxd.frontend.runtime import Runtime
from mlxd.observability.context import note_first


def runtime(request: Request) -> Runtime:
    return request.app.state.runtime


def new_id(prefix: str) -> str:
    rid = f"{prefix}-{uuid.uuid4().hex[:24]}"
    note_first(response_id=rid)  # the request's first id is its response's (traces)
    return rid


def now() -> int:
    return int(time.time())


@dataclass
class Collected:
    text: str = ""
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    stop_sequence: str | None = None


async def collect(gen: Generation) -> Collected:
    parts: list[str] = []
    thinking: list[str] = []
    out = Collected()
    event: TokenEvent
    async for event in gen:
        parts.append(event.text)
        if event.reasoning:
            thinking.append(event.reasoning)
        out.tool_calls.extend(event.tool_calls)
        out.logprobs.extend(event.logprobs)
        out.token_ids.extend(event.token_ids)
        if event.finish_reason is not None:
            out.finish_reason = event.finish_reason
            out.usage = event.usage or out.usage
            out.stop_sequence = event.stop_sequence
    out.text = "".join(parts)
    out.reasoning = "".join(thinking)
    return out


def usage_body(u: Usage) -> bodies.Usage:
    """OpenAI's usage object (prompt_tokens_details.cached_tokens: the prefix cache's hit)."""
    return bodies.Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        total_tokens=u.total_tokens,
        prompt_tokens_details=bodies.PromptTokensDetails(cached_tokens=u.cached_tokens),
        completion_tokens_details=None
        if u.reasoning_tokens is None
        else bodies.CompletionTokensDetails(reasoning_tokens=u.reasoning_tokens),
    )


def usage_dict(u: Usage) -> dict[str, Any]:
    """:func:`usage_body` for a hand-framed streamed event."""
    return usage_body(u).model_dump(mode="json", exclude_unset=True)


# -- n > 1: several sequences for one request ----------------------------------------------------


async def submit_n(request: Request, req: GenerateRequest, n: int) -> list[Generation]:
    """``n`` sequences of one request (choice i samples with ``seed + i`` when seeded).

    Each is its own Generation (own batch slot, admission and lease); all or none.
    """
    rt = runtime(request)
    if n == 1:
        return [await until_disconnect(request, rt.submit(req))]
    gens: list[Generation] = []
    try:
        for i in range(n):
            r = req
            if i and req.sampling.seed is not None:
                r = replace(req, sampling=replace(req.sampling, seed=req.sampling.seed + i))
            gens.append(await until_disconnect(request, rt.submit(r)))
    except BaseException:
        for g in gens:
            g.close()
        raise
    return gens


def close_all(gens: list[Generation]) -> Callable[[], None]:
    def close() -> None:
        for g in gens:
            g.close()

    return close


async def merged(gens: list[Generation]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """The events of several generations as (choice index, event), as they come."""
    if len(gens) == 1:
        async for ev in gens[0]:
            yield 0, ev
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, g: Generation) -> None:
        try:
            async for ev in g:
                q.put_nowait((i, ev))
        except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
            q.put_nowait((i, exc))
        finally:
            q.put_nowait((i, done))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            i, item = await q.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect_all(gens: list[Generation]) -> list[Collected]:
    if len(gens) == 1:
        return [await collect(gens[0])]
    tasks = [asyncio.ensure_future(collect(g)) for g in gens]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def total_usage(results: list[Collected]) -> Usage:
    """One request's usage over its choices: the prompt once, every completion."""
    first = results[0].usage
    return Usage(
        prompt_tokens=first.prompt_tokens,
        cached_tokens=first.cached_tokens,
        completion_tokens=sum(r.usage.completion_tokens for r in results),
        reasoning_tokens=None
        if first.reasoning_tokens is None
        else sum(r.usage.reasoning_tokens or 0 for r in results),
    )
