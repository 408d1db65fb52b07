"""Closed-loop streaming chat clients against one OpenAI-compatible server.

A pass is C clients, each sending its next request when its previous one ends, until each
has sent its share. Tokens are the stream's usage when the server sends it, else one per
content chunk; timings are what a streaming client sees (content chunks as they arrive).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

# Short common English words: about one token each in the usual BPE vocabularies.
WORDS = (
    "the of and to in is was for on that with as by at from his her an were are which "
    "this be or had it not but what all when we there can more one about time would so "
    "people river mountain city history science music market garden ocean language "
    "computer winter summer library engine question answer story morning evening"
).split()


def make_prompts(n: int, seed: int, prompt_tokens: int) -> list[str]:
    """``n`` prompts of about ``prompt_tokens`` words each, all different: each begins with
    a random tag of its own, so no prompt shares more than the chat template's prefix with
    another (no prefix cache hit across requests, passes or runs)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        tag = f"{rng.getrandbits(64):016x}"
        words = " ".join(rng.choice(WORDS) for _ in range(max(prompt_tokens - 8, 1)))
        out.append(f"[{tag}] Continue this text: {words}")
    return out


@dataclass(frozen=True)
class Target:
    """A server to send requests to: its base URL and the model name its requests carry."""

    name: str
    url: str
    model: str
    headers: dict[str, str] = field(default_factory=dict)


async def one_request(
    client: httpx.AsyncClient, target: Target, prompt: str, max_tokens: int
) -> dict[str, Any]:
    body = {
        "model": target.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    stamps: list[float] = []
    usage: dict[str, Any] = {}
    finish = None
    async with client.stream(
        "POST", target.url + "/v1/chat/completions", json=body, headers=target.headers
    ) as r:
        if r.status_code != 200:
            await r.aread()
            return {"error": f"HTTP {r.status_code}: {r.text[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if obj.get("error"):
                return {"error": json.dumps(obj["error"])[:200]}
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    stamps.append(time.perf_counter())
                finish = ch.get("finish_reason") or finish
    end = time.perf_counter()
    if not stamps:
        return {"error": "no content in the stream"}
    return {
        "ttft": stamps[0] - t0,
        "gaps": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
        "tokens": usage.get("completion_tokens") or len(stamps),
        "prompt_tokens": usage.get("prompt_tokens"),
        "finish_reason": finish,
        "latency": end - t0,
    }


async def run_pass(
    target: Target, prompts: list[str], concurrency: int, max_tokens: int
) -> dict[str, Any]:
    """``len(prompts)`` requests from ``concurrency`` closed-loop clients; raw results."""
    per_client = -(-len(prompts) // concurrency)
    results: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def worker(i: int) -> None:
            for prompt in prompts[i * per_client : (i + 1) * per_client]:
                try:
                    results.append(await one_request(client, target, prompt, max_tokens))
                except (httpx.HTTPError, ValueError) as exc:  # counted, not fatal
                    results.append({"error": f"{type(exc).__name__}: {exc}"[:200]})

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        wall = time.perf_counter() - t0
    return summarise(results, wall)


def pct(xs: list[float], p: float) -> float | None:
    """The nearest-rank percentile ``p`` of ``xs``; None for none."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def summarise(results: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """One pass: throughput over its wall time, and the raw per-request figures a side's
    summary pools over passes."""
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    prompt_tokens = [r["prompt_tokens"] for r in ok if r.get("prompt_tokens")]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_samples": [r["error"] for r in results if "error" in r][:3],
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tps": tokens / wall if wall > 0 else 0.0,
        "prompt_tokens_mean": statistics.mean(prompt_tokens) if prompt_tokens else None,
        "finished_by_length": sum(1 for r in ok if r["finish_reason"] == "length"),
        "ttft_s": [r["ttft"] for r in ok],
        "gaps_s": [g for r in ok for g in r["gaps"]],
    }
