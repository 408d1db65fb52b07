"""What a running Batch API job costs an interactive request: its time to first token (TTFT)
beside a 1,000-request batch against the same server idle.

Per pair: TTFT samples on the idle server, and TTFT samples while a batch of
``--batch-size`` short chat requests runs (a fresh batch each pair, measured once some of
its requests have finished, then cancelled so that the next idle samples are idle); the two
sides take turns in ABBA order, ``--pairs`` times (10 or more for a real measurement). Every
interactive prompt is new (random words): no prefix cache answers one. Reported: the
median and spread of each side's per-pair medians, and their ratio.

    python benchmarks/batch_interactive.py --pairs 10 --out result.json

Without ``--model-dir`` it makes a tiny llama (the test suite's fixture, 256 wide and 4
layers deep) in a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import mlxd_proc  # noqa: E402

WORDS = (
    "river mountain city history science music market garden ocean language computer "
    "winter summer library engine question answer story morning evening"
).split()


def prompt(rng: random.Random, n: int = 24) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def ttft(http: httpx.Client, rng: random.Random, max_tokens: int) -> float:
    """Seconds from sending a streamed chat request to its first content chunk."""
    body = {
        "messages": [{"role": "user", "content": prompt(rng)}],
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
    }
    t0 = time.perf_counter()
    first = None
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():  # read to its end: the slot is free after
            if first is not None or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            if delta.get("content"):
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("no content in the stream")
    return first


def start_batch(http: httpx.Client, rng: random.Random, n: int, max_tokens: int) -> str:
    lines = [
        json.dumps(
            {
                "custom_id": f"b-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "messages": [{"role": "user", "content": prompt(rng, 12)}],
                    "max_tokens": max_tokens,
                },
            }
        )
        for i in range(n)
    ]
    data = ("\n".join(lines) + "\n").encode()
    f = http.post("/v1/files", files={"file": ("b.jsonl", data)}, data={"purpose": "batch"}).json()
    b = http.post(
        "/v1/batches",
        json={
            "input_file_id": f["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    ).json()
    return b["id"]


def wait_batch(http: httpx.Client, bid: str, pred, timeout: float = 600) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        b = http.get(f"/v1/batches/{bid}").json()
        if pred(b):
            return b
        time.sleep(0.1)
    raise TimeoutError(f"batch {bid}: {b}")


def spread(xs: list[float]) -> dict:
    return {
        "median": statistics.median(xs),
        "min": min(xs),
        "max": max(xs),
        "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", help="a chat model directory (default: a tiny llama)")
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--samples", type=int, default=3, help="TTFT samples per side per pair")
    ap.add_argument("--batch-size", type=int, default=1000)
    ap.add_argument("--batch-max-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=4, help="the interactive request's")
    ap.add_argument("--warm-lines", type=int, default=20, help="batch lines done before TTFT")
    ap.add_argument("--max-concurrent", type=int, help="batch.max_concurrent (default: unset)")
    ap.add_argument("--out")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="mlxd-bench-"))
    model = args.model_dir
    if model is None:
        from fixtures.tiny_models import make_tiny_chat_model

        model = str(
            make_tiny_chat_model(
                tmp / "tiny-llama",
                "llama",
                hidden_size=256,
                num_layers=4,
                max_position_embeddings=2048,
                seed=1,
            )
        )
    env = {}
    if args.max_concurrent:
        env["MLXD_BATCH__MAX_CONCURRENT"] = str(args.max_concurrent)
    proc, url = mlxd_proc.start(str(tmp / "home"), model, env)
    rng = random.Random(0)
    idle: list[float] = []
    busy: list[float] = []
    rows: list[dict] = []
    try:
        with httpx.Client(base_url=url, timeout=600) as http:
            for _ in range(3):
                ttft(http, rng, args.max_tokens)  # warm: first compiles, first renders
            for pair in range(args.pairs):
                order = ("idle", "busy") if pair % 2 == 0 else ("busy", "idle")
                row: dict = {"pair": pair, "order": list(order)}
                for side in order:
                    if side == "idle":
                        xs = [ttft(http, rng, args.max_tokens) for _ in range(args.samples)]
                        row["idle_s"] = xs
                        idle.append(statistics.median(xs))
                        continue
                    bid = start_batch(http, rng, args.batch_size, args.batch_max_tokens)
                    t0 = time.time()
                    b0 = wait_batch(
                        http,
                        bid,
                        lambda b: b["request_counts"]["completed"] >= args.warm_lines,
                    )
                    xs = []
                    for _ in range(args.samples):
                        xs.append(ttft(http, rng, args.max_tokens))
                        time.sleep(0.2)  # the batch fills its slots again
                    b1 = http.get(f"/v1/batches/{bid}").json()
                    assert b1["status"] == "in_progress", b1["status"]
                    http.post(f"/v1/batches/{bid}/cancel")
                    wait_batch(http, bid, lambda b: b["status"] == "cancelled")
                    row["busy_s"] = xs
                    row["batch_done_while_measured"] = [
                        b0["request_counts"]["completed"],
                        b1["request_counts"]["completed"],
                    ]
                    row["batch_lines_per_s"] = b1["request_counts"]["completed"] / (
                        time.time() - t0
                    )
                    busy.append(statistics.median(xs))
                rows.append(row)
                print(
                    f"pair {pair}: idle {statistics.median(row['idle_s']) * 1000:.1f} ms, "
                    f"busy {statistics.median(row['busy_s']) * 1000:.1f} ms",
                    flush=True,
                )
            # one batch to its end: its throughput with nothing else running
            bid = start_batch(http, rng, args.batch_size, args.batch_max_tokens)
            t0 = time.time()
            done = wait_batch(http, bid, lambda b: b["status"] == "completed", timeout=3600)
            full = {
                "seconds": time.time() - t0,
                "request_counts": done["request_counts"],
            }
    finally:
        mlxd_proc.stop(proc)
    ratios = [b / i for b, i in zip(busy, idle, strict=True)]
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    result = {
        "benchmark": "batch_interactive",
        "command": "python " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "commit": commit,
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        "model": model if args.model_dir else "tiny llama (256 wide, 4 layers, fixture)",
        "settings": vars(args),
        "idle_ttft_s": spread(idle),
        "busy_ttft_s": spread(busy),
        "ratio_busy_over_idle": spread(ratios),
        "full_batch": full,
        "pairs": rows,
    }
    print(json.dumps({k: result[k] for k in ("idle_ttft_s", "busy_ttft_s")}, indent=1))
    print(f"ratio: median {statistics.median(ratios):.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
