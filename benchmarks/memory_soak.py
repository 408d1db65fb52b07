"""Server memory: idle RSS next to the weights, then growth after N mixed requests.

    python benchmarks/memory_soak.py [--model smollm2-135m-instruct] [--requests 1000]

Starts `mlxd serve`, reads RSS from /proc and MLX's active/cache/peak from /health, sends
N requests at concurrency C (a third streaming, a third non-streaming, a third streaming
requests that the client abandons after two chunks), then reads everything again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serve_compare import free_port, wait_healthy  # noqa: E402


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def snapshot(url: str, pid: int) -> dict:
    h = httpx.get(url + "/health", timeout=30).json()
    return {"rss_bytes": rss_bytes(pid), "mlx": h.get("memory", {}),
            "weights_bytes": sum(m.get("memory_bytes", 0) for m in h.get("models", [])),
            "prefix_cache_bytes": sum((m.get("prefix_cache") or {}).get("bytes", 0)
                                      for m in h.get("models", []))}


async def soak(url: str, model: str, n: int, concurrency: int, max_tokens: int) -> dict:
    rng = random.Random(0)
    counts = {"stream": 0, "plain": 0, "cancelled": 0, "errors": 0}
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, client: httpx.AsyncClient) -> None:
        kind = ("stream", "plain", "cancelled")[i % 3]
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0.7,
                "messages": [{"role": "user", "content": f"Say something about {rng.random()}"}],
                "stream": kind != "plain"}
        async with sem:
            try:
                if kind == "plain":
                    r = await client.post(url + "/v1/chat/completions", json=body)
                    r.raise_for_status()
                else:
                    async with client.stream("POST", url + "/v1/chat/completions",
                                             json=body) as r:
                        r.raise_for_status()
                        seen = 0
                        async for line in r.aiter_lines():
                            seen += line.startswith("data: ")
                            if kind == "cancelled" and seen >= 2:
                                break  # leaving the block closes the connection
                counts[kind] += 1
            except Exception:  # noqa: BLE001 - counted
                counts["errors"] += 1

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(one(i, client) for i in range(n)))
    return counts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--out", default=None)
    ap.add_argument("--prefix-cache-bytes", type=int, default=None,
                    help="engine.prefix_cache_bytes for the server (0: off)")
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if args.prefix_cache_bytes is not None:
        env["MLXD_ENGINE__PREFIX_CACHE_BYTES"] = str(args.prefix_cache_bytes)
    proc = subprocess.Popen([sys.executable, "-m", "mlxd", "serve", "--model", args.model,
                             "--port", str(port), "--log-level", "warning"], env=env)
    try:
        wait_healthy(url, proc, "/health")
        time.sleep(2)
        idle = snapshot(url, proc.pid)
        # one warm round so allocator pools and caches reach their working size
        asyncio.run(soak(url, args.model, 30, args.concurrency, args.max_tokens))
        warm = snapshot(url, proc.pid)
        t0 = time.time()
        counts = asyncio.run(soak(url, args.model, args.requests, args.concurrency,
                                  args.max_tokens))
        took = time.time() - t0
        time.sleep(2)
        after = snapshot(url, proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)
    res = {"idle": idle, "warm": warm, "after": after, "counts": counts, "seconds": took,
           "overhead_idle_bytes": idle["rss_bytes"] - idle["weights_bytes"],
           "growth_vs_warm": (after["rss_bytes"] - warm["rss_bytes"]) / warm["rss_bytes"],
           "growth_vs_warm_excluding_prefix_cache":
               (after["rss_bytes"] - after["prefix_cache_bytes"] - warm["rss_bytes"]
                + warm["prefix_cache_bytes"]) / warm["rss_bytes"]}
    print(json.dumps(res, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
