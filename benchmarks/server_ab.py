"""Two mlxd servers with different settings side by side, in ABBA waves of one load.

Both servers run at once (same model, same machine); each round sends one wave of
``serve_bench.py`` load (C streaming clients, fresh prompts per wave) to A then B, the next
round B then A, so a machine whose speed drifts (a shared host) meets both in about the same
state. Reports each wave and the median ratio B / A per round.

    python benchmarks/server_ab.py --model smollm2-135m-instruct --home $MLXD_HOME \
        --b-env MLXD_ENGINE__PREFIX_CACHE_BYTES=0 --rounds 8 --out ab.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import mlxd_proc  # noqa: E402


def env_pairs(items: list[str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in items)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--home", required=True, help="MLXD_HOME holding the model")
    ap.add_argument("--a-env", nargs="*", default=[], help="A's settings, VAR=VALUE")
    ap.add_argument("--b-env", nargs="*", default=[], help="B's settings, VAR=VALUE")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    envs = {"A": env_pairs(args.a_env), "B": env_pairs(args.b_env)}
    servers = {name: mlxd_proc.start(args.home, args.model, env) for name, env in envs.items()}
    waves: dict[str, list[dict]] = {"A": [], "B": []}
    bench = Path(__file__).parent / "serve_bench.py"
    try:
        seed = 100
        for r in range(args.rounds):
            for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                seed += 1
                out = Path(f"/tmp/server_ab-{name}-{r}.json")
                subprocess.run(
                    [
                        sys.executable,
                        str(bench),
                        "--url",
                        servers[name][1],
                        "--model",
                        args.model,
                        "--concurrency",
                        str(args.concurrency),
                        "--requests-per-client",
                        str(args.requests_per_client),
                        "--max-tokens",
                        str(args.max_tokens),
                        "--seed",
                        str(seed),
                        "--warmup",
                        "0",
                        "--out",
                        str(out),
                    ],
                    stdout=subprocess.DEVNULL,
                    check=True,
                )
                lv = json.loads(out.read_text())["levels"][0]
                waves[name].append(
                    {
                        "round": r,
                        "tok_s": lv["output_tps"],
                        "itl_p50_ms": lv["itl_p50"] * 1000,
                        "ttft_p50_ms": lv["ttft_p50"] * 1000,
                        "errors": lv["errors"],
                    }
                )
                print(r, name, {k: round(v, 1) for k, v in waves[name][-1].items()}, flush=True)
    finally:
        for proc, _ in servers.values():
            mlxd_proc.stop(proc)
    ratios = [b["tok_s"] / a["tok_s"] for a, b in zip(waves["A"], waves["B"], strict=True)]
    print(
        "B / A per round:",
        [round(x, 2) for x in ratios],
        "median",
        round(statistics.median(ratios), 3),
    )
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "command": " ".join(sys.argv),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
                    "envs": envs,
                    "waves": waves,
                    "ratios_b_over_a": ratios,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
