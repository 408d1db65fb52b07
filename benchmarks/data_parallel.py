"""Data parallel: mlxd with one engine core vs one per device, same model, same load.

    python benchmarks/data_parallel.py --model-dir DIR --devices "0;0,1" \
        [--concurrency 128] [--max-tokens 128] [--requests-per-client 3] [--out dp.json]

Each ``--devices`` entry (``;``-separated) is one `mlxd serve --devices ...` run, measured
as benchmarks/serve_compare.py measures mlxd (a warm-up pass with other prompts, then the
measured pass, streaming clients from serve_bench.py). The table gives each run's output
tokens/s and its ratio to the first run's. On a CPU-only host ``"cpu:1;cpu:2"`` exercises
the same path (several cores on one CPU share its memory bandwidth: no 2x to expect).
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
    ap.add_argument(
        "--devices",
        default="0;0,1",
        help="';'-separated mlxd --devices values, one run each; the first is the baseline",
    )
    ap.add_argument("--concurrency", default="128")
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
    ap.add_argument(
        "--client-procs", type=int, default=1, help="spread the clients over this many processes"
    )
    ap.add_argument("--api-workers", type=int, default=1)
    ap.add_argument("--logdir", default="/tmp")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.levels = [int(x) for x in args.concurrency.split(",")]
    specs = [s.strip() for s in args.devices.split(";") if s.strip()]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    name = Path(args.model_dir).name
    results: dict = {
        "model_dir": args.model_dir,
        "max_tokens": args.max_tokens,
        "command": " ".join(sys.argv),
        "runs": {},
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    for spec in specs:
        print(f"mlxd --devices {spec}", flush=True)
        results["runs"][spec] = serve_compare.bench_server(
            [
                sys.executable,
                "-m",
                "mlxd",
                "serve",
                "--model",
                args.model_dir,
                "--max-num-seqs",
                str(max(args.levels)),
                "--log-level",
                "warning",
                "--api-workers",
                str(args.api_workers),
                "--devices",
                spec,
            ],
            env,
            name,
            args,
            "/health",
        )
    base = results["runs"][specs[0]]
    print(
        "\n| C | "
        + " | ".join(f"--devices {s} tok/s" for s in specs)
        + " | "
        + " | ".join(f"{s} / {specs[0]}" for s in specs[1:])
        + " | errors |"
    )
    print("|---" * (2 + 2 * len(specs) - 1) + "|")
    for i, c in enumerate(args.levels):
        tps = [results["runs"][s][i]["output_tps"] for s in specs]
        errors = sum(results["runs"][s][i]["errors"] for s in specs)
        ratios = [f"{t / base[i]['output_tps']:.2f}" for t in tps[1:]]
        print(
            f"| {c} | "
            + " | ".join(f"{t:.1f}" for t in tps)
            + " | "
            + " | ".join(ratios)
            + f" | {errors} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
