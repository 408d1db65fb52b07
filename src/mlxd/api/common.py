"""Small helpers the dialect routers share."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from fastapi import Request

from mlxd.core.types import TokenEvent, TokenLogprob, Usage
from mlxd.runtime.service import Generation, Runtime


def runtime(request: Request) -> Runtime:
    return request.app.state.runtime


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


@dataclass
class Collected:
    text: str = ""
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


async def collect(gen: Generation) -> Collected:
    parts: list[str] = []
    out = Collected()
    event: TokenEvent
    async for event in gen:
        parts.append(event.text)
        out.logprobs.extend(event.logprobs)
        out.token_ids.extend(event.token_ids)
        if event.finish_reason is not None:
            out.finish_reason = event.finish_reason
            out.usage = event.usage or out.usage
    out.text = "".join(parts)
    return out


def usage_dict(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens}
