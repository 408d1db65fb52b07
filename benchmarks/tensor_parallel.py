"""mlxd with the model split over N ranks (--tensor-parallel N, or with --mode pipeline
--pipeline-parallel N) against one device.

    python benchmarks/make_random_model.py --shape qwen2.5-7b --dtype bfloat16 --out /tmp/q7
    python benchmarks/tensor_parallel.py --model-dir /tmp/q7 --out tp.json \
        [--mode tensor|pipeline] [--tp 1,2] [--concurrency 1,32] [--max-tokens 128] \
        [--requests-per-client 3]

Each --tp value starts ``python -m mlxd serve --model DIR --tensor-parallel N`` (or
``--pipeline-parallel N``; NCCL, one GPU per rank, on CUDA; the ring backend over loopback
on a CPU), waits for /health, and
runs C concurrent streaming greedy chat clients per level (serve_bench.py; a warm-up run of
the same shape first). The table gives output tokens/s, TTFT and per-request decode speed,
and each N's ratio to N=1 at the same C. What to expect: at C=1 a decode step is bound by
reading the weights, which N devices split (minus two all-reduces per layer per step); at
large C the step is compute-bound and splits too, so both should gain on a model large
enough that the all-reduces are small beside the matmuls. Pipelined, a step runs the ranks
one after the other, so expect no gain over one device that holds the model (its point is
a model no single device holds), only the hand-offs' cost.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import serve_compare  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--mode",
        choices=("tensor", "pipeline"),
        default="tensor",
        help="how the model is split: --tensor-parallel or --pipeline-parallel",
    )
    ap.add_argument("--tp", default="1,2", help="comma list of rank counts")
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-words", type=int, default=8)
    ap.add_argument("--max-words", type=int, default=64)
    ap.add_argument(
        "--short-warmup",
        action="store_true",
        help="warm up with one 8-token request per client (CPU: nothing compiles)",
    )
    ap.add_argument("--client-procs", type=int, default=1)
    ap.add_argument("--logdir", default="/tmp")
    ap.add_argument("--mlxd-args", default="", help="extra mlxd serve arguments")
    args = ap.parse_args()
    args.levels = [int(x) for x in args.concurrency.split(",")]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    name = Path(args.model_dir).resolve().name
    flag = f"--{args.mode}-parallel"
    results: dict = {
        "model_dir": args.model_dir,
        "command": " ".join(sys.argv),
        "mode": args.mode,
        "max_tokens": args.max_tokens,
        "requests_per_client": args.requests_per_client,
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "runs": {},
    }
    for n in [int(x) for x in args.tp.split(",")]:
        print(f"{flag} {n}", flush=True)
        results["runs"][str(n)] = serve_compare.bench_server(
            [
                sys.executable,
                "-m",
                "mlxd",
                "serve",
                "--model",
                args.model_dir,
                flag,
                str(n),
                "--max-num-seqs",
                str(max(args.levels)),
                "--log-level",
                "warning",
                *args.mlxd_args.split(),
            ],
            env,
            name,
            args,
            "/health",
        )
        Path(args.out).write_text(json.dumps(results, indent=2))
    print(table(results))


def table(results: dict) -> str:
    runs = results["runs"]
    base = runs.get("1")
    lines = [
        "| ranks | C | output tok/s | vs 1 rank | TTFT p50 s | decode tok/s per request |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for n, levels in runs.items():
        for i, r in enumerate(levels):
            ratio = (
                f"{r['output_tps'] / base[i]['output_tps']:.2f}x"
                if base and base[i]["output_tps"]
                else "-"
            )
            lines.append(
                f"| {n} | {r['concurrency']} | {r['output_tps']:.1f} | {ratio} | "
                f"{r['ttft_p50'] or 0:.3f} | {r['decode_tps_per_request'] or 0:.1f} |"
                + (f" errors {r['errors']}" if r["errors"] else "")
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
