"""A mixed-traffic soak against a live mlxd, shared by tests/ops/test_soak.py (short, CI)
and benchmarks/soak.py (2,000 requests at C=64).

Traffic: chat (streamed and not), completions, embeddings, rerank, tokenize, Ollama
/api/chat and /api/generate, Anthropic /v1/messages, at concurrency C. 20% of the streaming
clients leave after their first chunk (the server must abort their sequences and free the
slots); 5% of all requests carry a malformed body (not JSON, a wrong type, a missing field:
each must be a 4xx). What is measured: every status, 5xx and transport errors (both must
stay 0), error events inside 200 streams, latency percentiles, and the resident memory
(VmRSS) of the server's processes at the middle and at the end of the run, so growth over
the second half (after warm-up, caches filled) shows a leak rather than a warm-up.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

KINDS = (
    "chat",
    "chat_stream",
    "completion",
    "embed",
    "rerank",
    "tokenize",
    "ollama_chat",
    "ollama_generate",
    "anthropic",
    "anthropic_stream",
)
STREAMING = {"chat_stream", "ollama_chat", "ollama_generate", "anthropic_stream"}


def rss_kib(pid: int) -> int:
    """VmRSS of ``pid`` in KiB (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


@dataclass
class Models:
    chat: str
    embed: str
    rerank: str


@dataclass
class SoakResult:
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    by_kind: dict[str, Counter] = field(default_factory=dict)
    disconnected: int = 0
    malformed: int = 0
    malformed_not_4xx: list[str] = field(default_factory=list)
    stream_errors: list[str] = field(default_factory=list)
    transport_errors: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    rss_mid: dict[str, int] = field(default_factory=dict)
    rss_end: dict[str, int] = field(default_factory=dict)
    # the engine core's own books at the same moments (MLX active/cache bytes, prefix
    # caches): tells a cache filling to its bound from memory nobody accounts for
    memory_mid: dict[str, int] = field(default_factory=dict)
    memory_end: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def server_errors(self) -> int:
        return sum(n for s, n in self.statuses.items() if s >= 500)

    def rss_growth(self) -> dict[str, float]:
        """Relative RSS growth per process over the second half of the run."""
        return {k: (self.rss_end[k] - v) / v for k, v in self.rss_mid.items() if v}

    def as_dict(self) -> dict[str, Any]:
        lat = sorted(self.latencies)

        def pct(q: float) -> float:
            return round(lat[min(len(lat) - 1, int(q * len(lat)))], 3) if lat else 0.0

        return {
            "requests": self.requests,
            "seconds": round(self.seconds, 1),
            "requests_per_second": round(self.requests / self.seconds, 1) if self.seconds else 0.0,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
            "by_kind": {
                k: {str(s): n for s, n in sorted(c.items())}
                for k, c in sorted(self.by_kind.items())
            },
            "server_errors_5xx": self.server_errors,
            "transport_errors": self.transport_errors[:20],
            "stream_errors": self.stream_errors[:20],
            "disconnected_mid_stream": self.disconnected,
            "malformed": self.malformed,
            "malformed_not_4xx": self.malformed_not_4xx[:20],
            "latency_s": {
                "p50": pct(0.5),
                "p90": pct(0.9),
                "p99": pct(0.99),
                "max": round(lat[-1], 3) if lat else 0.0,
            },
            "rss_kib": {"middle": self.rss_mid, "end": self.rss_end},
            "engine_memory_bytes": {"middle": self.memory_mid, "end": self.memory_end},
            "rss_growth_second_half": {k: round(v, 4) for k, v in self.rss_growth().items()},
        }


def memory_books(health: dict[str, Any]) -> dict[str, int]:
    """MLX's active and cache bytes and the prefix caches' bytes, from a /health body."""
    mem = health.get("memory", {})
    return {
        "mlx_active": int(mem.get("active_bytes", 0)),
        "mlx_cache": int(mem.get("cache_bytes", 0)),
        "prefix_caches": sum(
            int((m.get("prefix_cache") or {}).get("bytes", 0)) for m in health.get("models", [])
        ),
    }


def _request(kind: str, m: Models, i: int, max_tokens: int) -> tuple[str, dict[str, Any]]:
    text = f"Request {i}: tell me something about the number {i % 97}."
    msgs = [{"role": "user", "content": text}]
    if kind in ("chat", "chat_stream"):
        return "/v1/chat/completions", {
            "model": m.chat,
            "messages": msgs,
            "max_tokens": max_tokens,
            "temperature": 0.7,
            "stream": kind == "chat_stream",
        }
    if kind == "completion":
        return "/v1/completions", {"model": m.chat, "prompt": text, "max_tokens": max_tokens}
    if kind == "embed":
        return "/v1/embeddings", {"model": m.embed, "input": [text, f"short {i}"]}
    if kind == "rerank":
        return "/v1/rerank", {
            "model": m.rerank,
            "query": text,
            "documents": ["a number", "a colour", f"the number {i % 97}"],
        }
    if kind == "tokenize":
        return "/v1/tokenize", {"model": m.chat, "messages": msgs}
    if kind == "ollama_chat":
        return "/api/chat", {
            "model": m.chat,
            "messages": msgs,
            "options": {"num_predict": max_tokens},
        }
    if kind == "ollama_generate":
        return "/api/generate", {
            "model": m.chat,
            "prompt": text,
            "options": {"num_predict": max_tokens},
        }
    return "/v1/messages", {
        "model": m.chat,
        "messages": msgs,
        "max_tokens": max_tokens,
        "stream": kind == "anthropic_stream",
    }


def _malformed(rng: random.Random, path: str, body: dict[str, Any]) -> bytes:
    choice = rng.randrange(3)
    if choice == 0:
        return json.dumps(body).encode()[:-7]  # cut short: not JSON
    if choice == 1:
        bad = dict(body, model=12345)  # a wrong type
        return json.dumps(bad).encode()
    # the payload field of the wrong JSON type (a missing prompt is valid in Ollama: a load)
    bad = {k: (5 if k in ("messages", "prompt", "input", "query") else v) for k, v in body.items()}
    return json.dumps(bad).encode()


def _stream_error(kind: str, text: str) -> bool:
    if kind in ("ollama_chat", "ollama_generate"):
        return any('"error"' in line for line in text.splitlines())
    return "event: error" in text or '"error"' in text


async def run_soak(
    url: str,
    models: Models,
    *,
    requests: int,
    concurrency: int,
    pids: dict[str, int],
    max_tokens: int = 8,
    disconnect: float = 0.2,
    malformed: float = 0.05,
    seed: int = 0,
    on_progress: Callable[[int], None] | None = None,
) -> SoakResult:
    rng = random.Random(seed)
    res = SoakResult()
    plan = [
        (i, rng.choice(KINDS), rng.random() < malformed, rng.random() < disconnect)
        for i in range(requests)
    ]
    queue: asyncio.Queue = asyncio.Queue()
    for item in plan:
        queue.put_nowait(item)
    done = 0
    half = requests // 2
    pending: list[asyncio.Future] = []

    async def one(c: httpx.AsyncClient, i: int, kind: str, bad: bool, leave: bool) -> None:
        nonlocal done
        path, body = _request(kind, models, i, max_tokens)
        t0 = time.monotonic()
        status = None
        try:
            if bad:
                res.malformed += 1
                r = await c.post(
                    path,
                    content=_malformed(rng, path, body),
                    headers={"content-type": "application/json"},
                )
                status = r.status_code
                if not 400 <= status < 500:
                    res.malformed_not_4xx.append(f"{path} -> {status}: {r.text[:200]}")
            elif kind in STREAMING:
                body = {**body, "stream": True}
                async with c.stream("POST", path, json=body) as r:
                    status = r.status_code
                    if leave and status == 200:
                        async for _ in r.aiter_bytes():
                            break  # the client goes away after its first chunk
                        res.disconnected += 1
                    else:
                        text = (await r.aread()).decode(errors="replace")
                        if status == 200 and _stream_error(kind, text):
                            res.stream_errors.append(f"{path}: {text[-300:]}")
            else:
                r = await c.post(path, json=body)
                status = r.status_code
        except httpx.HTTPError as exc:
            res.transport_errors.append(f"{path}: {type(exc).__name__}: {exc}")
        finally:
            res.latencies.append(time.monotonic() - t0)
            if status is not None:
                res.statuses[status] += 1
                res.by_kind.setdefault(kind, Counter())[status] += 1
            res.requests += 1
            done += 1
            if done == half:
                res.rss_mid = {k: rss_kib(p) for k, p in pids.items()}
                mid = asyncio.ensure_future(c.get("/health"))
                mid.add_done_callback(
                    lambda f: res.memory_mid.update(
                        memory_books(f.result().json()) if not f.exception() else {}
                    )
                )
                pending.append(mid)
            if on_progress is not None:
                on_progress(done)

    async def worker(c: httpx.AsyncClient) -> None:
        while True:
            try:
                item = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            await one(c, *item)

    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        await asyncio.gather(*(worker(c) for _ in range(concurrency)))
        await asyncio.gather(*pending, return_exceptions=True)
    res.seconds = time.monotonic() - t0
    return res


def wait_idle(url: str, timeout: float = 30) -> dict[str, Any]:
    """/health (with details) once nothing is in flight, running or waiting."""
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(url + "/health", timeout=10).json()
        busy = h.get("requests_in_flight", 0) or any(
            m.get("running", 0) or m.get("waiting", 0) for m in h.get("models", [])
        )
        if not busy or time.monotonic() > deadline:
            return h
        time.sleep(0.2)
