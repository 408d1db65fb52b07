"""Cold start: `mlxd serve` to healthy with the default model, and first vs second request.

    python benchmarks/cold_start.py [--model smollm2-135m-instruct] [--runs 3]

Three different questions of similar length, with the prefix cache off. The model must
already be in the store (run `mlxd pull` once); the time to fetch it is a
network matter and reported separately by `mlxd pull`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serve_compare import free_port, wait_healthy  # noqa: E402


def request(url: str, model: str, i: int) -> float:
    question = ("What is MLX?", "Name a river.", "Why is the sky blue?")[i % 3]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 16,
        "temperature": 0.7,
    }
    t0 = time.perf_counter()
    httpx.post(url + "/v1/chat/completions", json=body, timeout=300).raise_for_status()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-warmup", action="store_true", help="start with engine.warmup off")
    args = ap.parse_args()
    rows = []
    for _ in range(args.runs):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        # The prefix cache would serve the later requests' shared template prefix from the
        # first one's KV cache and flatter them: this measures warm-up alone.
        env = dict(os.environ, HF_HUB_OFFLINE="1", MLXD_ENGINE__PREFIX_CACHE_BYTES="0")
        if args.no_warmup:
            env["MLXD_ENGINE__WARMUP"] = "false"
        t0 = time.perf_counter()
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
            ],
            env=env,
        )
        try:
            wait_healthy(url, proc, "/health")
            ready = time.perf_counter() - t0
            first, second, third = (request(url, args.model, i) for i in range(3))
        finally:
            proc.terminate()
            proc.wait(30)
        rows.append({"to_healthy_s": ready, "first_s": first, "second_s": second, "third_s": third})
        print(json.dumps(rows[-1]), flush=True)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(json.dumps({"median": med, "first_over_second": med["first_s"] / med["second_s"]}))


if __name__ == "__main__":
    main()
