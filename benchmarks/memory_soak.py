"""Server memory: idle RSS next to the weights, then growth after N mixed requests.

    python benchmarks/memory_soak.py [--model smollm2-135m-instruct] [--requests 1000]

Starts `mlxd serve`, reads RSS from /proc and MLX's active/cache/peak from /health, sends
N requests at concurrency C (in turn: streaming, non-streaming, streaming requests that the
client abandons after two chunks, and non-streaming structured output with a JSON schema),
then reads everything again.

RSS is read per process: the front end(s) (the `mlxd serve` process, and uvicorn's worker
processes with --api-workers > 1) hold HTTP, templating, tokenizing and detokenizing; the
engine core(s) hold MLX, the weights and the caches. `rss_bytes` is their sum.
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


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    kids = [int(x) for x in out.split()]
    return kids + [d for k in kids for d in descendants(k)]


def processes(pid: int) -> dict[str, list[int]]:
    """The serving tree's processes by role (uvicorn's multiprocess manager, with
    --api-workers > 1, is a front end that serves nothing: it counts as "manager")."""
    roles: dict[str, list[int]] = {"front_end": [], "engine_core": [], "other": []}
    for p in [pid, *descendants(pid)]:
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "mlxd.enginecore" in cmd:
            roles["engine_core"].append(p)
        elif p == pid or "multiprocessing" in cmd or "mlxd" in cmd:
            roles["front_end"].append(p)
        else:
            roles["other"].append(p)  # e.g. a resource tracker
    return roles


def snapshot(url: str, pid: int) -> dict:
    h = httpx.get(url + "/health", timeout=30).json()
    roles = processes(pid)
    by_role = {role: [rss_bytes(p) for p in pids] for role, pids in roles.items()}
    return {
        "rss_bytes": sum(sum(v) for v in by_role.values()),
        "rss_by_role": by_role,
        "mlx": h.get("memory", {}),
        "weights_bytes": h.get("memory", {}).get("models_bytes", 0),
        "prefix_cache_bytes": sum(
            (m.get("prefix_cache") or {}).get("bytes", 0) for m in h.get("models", [])
        ),
    }


async def soak(url: str, model: str, n: int, concurrency: int, max_tokens: int) -> dict:
    rng = random.Random(0)
    counts = {"stream": 0, "plain": 0, "cancelled": 0, "schema": 0, "errors": 0}
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, client: httpx.AsyncClient) -> None:
        kind = ("stream", "plain", "cancelled", "schema")[i % 4]
        body = {
            "model": model,
            "max_tokens": max_tokens,
            "temperature": 0.7,
            "messages": [{"role": "user", "content": f"Say something about {rng.random()}"}],
            "stream": kind in ("stream", "cancelled"),
        }
        if kind == "schema":  # each a new schema: grammars are compiled, not only cached
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {
                        "type": "object",
                        "required": [f"k{i}"],
                        "properties": {f"k{i}": {"type": "string"}},
                    },
                },
            }
        async with sem:
            try:
                if not body["stream"]:
                    r = await client.post(url + "/v1/chat/completions", json=body)
                    r.raise_for_status()
                else:
                    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
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
    ap.add_argument("--api-workers", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--prefix-cache-bytes",
        type=int,
        default=None,
        help="engine.prefix_cache_bytes for the server (0: off)",
    )
    args = ap.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if args.prefix_cache_bytes is not None:
        env["MLXD_ENGINE__PREFIX_CACHE_BYTES"] = str(args.prefix_cache_bytes)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlxd",
            "serve",
            "--model",
            args.model,
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--api-workers",
            str(args.api_workers),
        ],
        env=env,
    )
    try:
        wait_healthy(url, proc, "/health")
        time.sleep(2)
        idle = snapshot(url, proc.pid)
        # one warm round so allocator pools and caches reach their working size
        # a model given as a folder is served under the folder's name
        name = Path(args.model).name if os.path.isdir(args.model) else args.model
        asyncio.run(soak(url, name, 30, args.concurrency, args.max_tokens))
        warm = snapshot(url, proc.pid)
        t0 = time.time()
        counts = asyncio.run(soak(url, name, args.requests, args.concurrency, args.max_tokens))
        took = time.time() - t0
        time.sleep(2)
        after = snapshot(url, proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)
    res = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.uname().machine} {os.cpu_count()} cpus",
        "idle": idle,
        "warm": warm,
        "after": after,
        "counts": counts,
        "seconds": took,
        "overhead_idle_bytes": idle["rss_bytes"] - idle["weights_bytes"],
        # the figure that grows with --api-workers: each front end's RSS (no weights)
        "front_end_rss_max_bytes": {
            k: max(v["rss_by_role"]["front_end"])
            for k, v in (("idle", idle), ("warm", warm), ("after", after))
        },
        "growth_vs_warm": (after["rss_bytes"] - warm["rss_bytes"]) / warm["rss_bytes"],
        "growth_vs_warm_excluding_prefix_cache": (
            after["rss_bytes"]
            - after["prefix_cache_bytes"]
            - warm["rss_bytes"]
            + warm["prefix_cache_bytes"]
        )
        / warm["rss_bytes"],
    }
    print(json.dumps(res, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
