"""What LoRA adapters per request cost a batch: decode throughput of C streaming clients all
on the base model against the same clients spread over 4 adapters (and the base), on one
server, in interleaved passes (ABBA), each pass with fresh prompts.

    PYTHONPATH=src python benchmarks/lora_mixed.py --model DIR --concurrency 16 \
        --pairs 10 --max-tokens 64 --out result.json

The adapters are random (rank --rank on every attention and MLP projection of every layer,
mlx-lm's format, made here); what is measured is the arithmetic of the gathered low-rank
updates, not their quality. Prints JSON and writes it to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import mlxd_proc  # noqa: E402


def make_adapter(model_dir: Path, out: Path, rank: int, seed: int) -> None:
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    model, _ = load(str(model_dir))
    params = {
        "rank": rank,
        "scale": 10.0,
        "dropout": 0.0,
        "keys": [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ],
    }
    model.freeze()
    linear_to_lora_layers(model, len(model.layers), params)
    rng = np.random.default_rng(seed)
    weights = {
        k: mx.array(rng.normal(size=v.shape).astype(np.float32) * 0.01)
        if k.endswith("lora_b")
        else v
        for k, v in tree_flatten(model.trainable_parameters())
    }
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    (out / "adapter_config.json").write_text(
        json.dumps(
            {"fine_tune_type": "lora", "num_layers": len(model.layers), "lora_parameters": params}
        )
    )


async def one_client(
    client: httpx.AsyncClient, url: str, model: str, max_tokens: int, tag: str
) -> int:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"[{tag}] Write a long story about the sea."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    tokens = ev["usage"]["completion_tokens"]
    return tokens


async def one_pass(url: str, models: list[str], c: int, max_tokens: int) -> float:
    async with httpx.AsyncClient(timeout=600) as client:
        tag = f"{random.random():.12f}"
        t0 = time.perf_counter()
        counts = await asyncio.gather(
            *(
                one_client(client, url, models[i % len(models)], max_tokens, f"{tag}-{i}")
                for i in range(c)
            )
        )
        return sum(counts) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="an MLX chat model directory")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    adapters = [f"lora{i}" for i in range(4)]
    for i, name in enumerate(adapters):
        make_adapter(Path(args.model), work / name, args.rank, i)
    server, url = mlxd_proc.start(str(work / "home"), args.model)
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    runs: dict[str, list[float]] = {"base": [], "mixed": []}
    ratios: list[float] = []

    def save() -> dict[str, Any]:
        """The result so far, written to --out after every pair (a run cut short keeps
        what it measured)."""
        result: dict[str, Any] = {
            "benchmark": "lora_mixed",
            "command": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": commit,
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "load_average": os.getloadavg(),
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "rank": args.rank,
            "runs": runs,
        }
        if ratios:
            result["mixed_over_base"] = {
                "median": statistics.median(ratios),
                "min": min(ratios),
                "max": max(ratios),
                "pairs": ratios,
            }
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        return result

    try:
        base = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        for name in adapters:
            r = httpx.post(
                url + "/v1/load_lora_adapter",
                json={"lora_name": name, "lora_path": str(work / name)},
                timeout=600,
            )
            r.raise_for_status()
        sides = {"base": [base], "mixed": [*adapters, base]}
        for side in sides.values():  # warm-up
            asyncio.run(one_pass(url, side, args.concurrency, 8))
        for k in range(args.pairs):
            order = ["base", "mixed"] if k % 2 == 0 else ["mixed", "base"]
            got = {
                s: asyncio.run(one_pass(url, sides[s], args.concurrency, args.max_tokens))
                for s in order
            }
            for s, v in got.items():
                runs[s].append(v)
            ratios.append(got["mixed"] / got["base"])
            print(
                f"pair {k}: base {got['base']:.1f} tok/s, mixed {got['mixed']:.1f} tok/s",
                flush=True,
            )
            save()
    finally:
        mlxd_proc.stop(server)
    print(json.dumps(save(), indent=1))


if __name__ == "__main__":
    main()
