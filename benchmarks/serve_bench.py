"""Load generator for any OpenAI-compatible server: C concurrent streaming chat clients.

Each client sends requests back to back (fixed max_tokens, greedy, prompts of seeded random
length) until it has sent its share. Reports aggregate output tokens/s, TTFT p50/p95,
inter-token latency p50/p95 and errors. Tokens are counted from the stream's usage when
the server sends it (stream_options.include_usage), else one per content chunk.

    python benchmarks/serve_bench.py --url http://127.0.0.1:8000 --model NAME \
        --concurrency 1,4,16,32 --requests-per-client 4 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

WORDS = (
    "the of and to in is was for on that with as by at from his her an were are which "
    "this be or had it not but what all when we there can more one about time would so "
    "people river mountain city history science music market garden ocean language "
    "computer winter summer library engine question answer story morning evening"
).split()


def make_prompts(n: int, seed: int, min_words: int, max_words: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(min_words, max_words)
        out.append("Continue this text: " + " ".join(rng.choice(WORDS) for _ in range(k)))
    return out


def level_seeds(seed: int, concurrency: int) -> tuple[int, int]:
    """(warm-up, measured) prompt seeds of one concurrency level: every level and pass gets
    prompts of its own. With one seed for all levels, a level's first prompts were the
    previous level's, and a server with a prefix cache answered them from it."""
    base = seed + 2 * concurrency
    return base + 1, base


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int
) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = None
    stamps: list[float] = []
    chunks = 0
    usage_tokens = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"error": f"HTTP {r.status_code}: {r.text[:200]}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if obj.get("usage"):
                usage_tokens = obj["usage"].get("completion_tokens")
            for ch in obj.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    stamps.append(now)
                    chunks += 1
    end = time.perf_counter()
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    return {
        "ttft": (first or end) - t0,
        "itl": itl,
        "tokens": usage_tokens or chunks,
        "latency": end - t0,
    }


def _client_proc(args: tuple) -> tuple[list[dict], float]:
    url, model, clients, first, per_client, max_tokens, seed, lo, hi, start_at = args
    time.sleep(max(0.0, start_at - time.time()))
    return asyncio.run(
        _run_clients(url, model, clients, first, per_client, max_tokens, seed, lo, hi)
    )


async def _run_clients(
    url: str,
    model: str,
    clients: int,
    first: int,
    per_client: int,
    max_tokens: int,
    seed: int,
    lo: int,
    hi: int,
) -> tuple[list[dict], float]:
    prompts = make_prompts((first + clients) * per_client, seed, lo, hi)
    results: list[dict] = []
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def worker(i: int) -> None:
            for j in range(per_client):
                try:
                    results.append(
                        await one_request(
                            client, url, model, prompts[i * per_client + j], max_tokens
                        )
                    )
                except Exception as exc:  # noqa: BLE001 - counted, not fatal
                    results.append({"error": repr(exc)})

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(first + i) for i in range(clients)))
        return results, time.perf_counter() - t0


def run_level_procs(
    url: str,
    model: str,
    concurrency: int,
    per_client: int,
    max_tokens: int,
    seed: int,
    min_words: int,
    max_words: int,
    processes: int,
) -> dict:
    """The same load from several client processes, so the client's own GIL is no limit."""
    from concurrent.futures import ProcessPoolExecutor

    procs = max(1, min(processes, concurrency))
    shares = [concurrency // procs + (1 if i < concurrency % procs else 0) for i in range(procs)]
    starts = [sum(shares[:i]) for i in range(procs)]
    start_at = time.time() + 1.0
    jobs = [
        (url, model, n, first, per_client, max_tokens, seed, min_words, max_words, start_at)
        for n, first in zip(shares, starts)
    ]
    with ProcessPoolExecutor(procs) as ex:
        outs = list(ex.map(_client_proc, jobs))
    results = [r for rs, _ in outs for r in rs]
    return _summarise(concurrency, results, max(w for _, w in outs))


async def run_level(
    url: str,
    model: str,
    concurrency: int,
    per_client: int,
    max_tokens: int,
    seed: int,
    min_words: int,
    max_words: int,
) -> dict:
    results, wall = await _run_clients(
        url, model, concurrency, 0, per_client, max_tokens, seed, min_words, max_words
    )
    return _summarise(concurrency, results, wall)


def _summarise(concurrency: int, results: list[dict], wall: float) -> dict:
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in ok]
    itl = [x for r in ok for x in r["itl"]]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_samples": [r["error"] for r in results if "error" in r][:3],
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tps": tokens / wall if wall else 0,
        "ttft_p50": pct(ttft, 50),
        "ttft_p95": pct(ttft, 95),
        "itl_p50": pct(itl, 50),
        "itl_p95": pct(itl, 95),
        "decode_tps_per_request": statistics.median(
            [(r["tokens"] - 1) / max(r["latency"] - r["ttft"], 1e-9) for r in ok if r["tokens"] > 1]
        )
        if ok
        else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-words", type=int, default=8)
    ap.add_argument("--max-words", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=1, help="requests before measuring")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.warmup:
        asyncio.run(run_level(args.url, args.model, 1, args.warmup, 8, 999, 4, 8))
    levels = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        res = asyncio.run(
            run_level(
                args.url,
                args.model,
                c,
                args.requests_per_client,
                args.max_tokens,
                args.seed,
                args.min_words,
                args.max_words,
            )
        )
        print(json.dumps(res), flush=True)
        levels.append(res)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "url": args.url,
                    "model": args.model,
                    "levels": levels,
                    "max_tokens": args.max_tokens,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
