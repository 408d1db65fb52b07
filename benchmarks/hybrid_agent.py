"""Turn 10 of an agent conversation on models with recurrent or sliding-window layers:
time to first token with prefix reuse (checkpoints) and without (prefix cache off).

Each pair is one conversation: a long system prompt listing tools, then short user turns,
each resending the whole history with the previous reply re-rendered (``Result: <reply>``,
as agent frameworks and reasoning templates do), so the cached sequence is never a prefix
of the next prompt; only the previous prompt is. Turns 1-9 run on the server with the
prefix cache; turn 10 is then sent to both servers, in alternating order, one request at a
time. The models are tests/fixtures/hybrid_models.py's tiny random ones (Qwen3-Next's
Gated DeltaNet, Gemma 3's sliding window, Mamba-2), whose prefill on a CPU is slow enough
to measure.

    python benchmarks/hybrid_agent.py --pairs 10 --out docs/results/cpu-hybrid-agent-DATE.json
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import mlxd_proc
from prefix_disk import ASKS, TASKS, machine, system_prompt, turn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fixtures.hybrid_models import HYBRID_ARCHS, make_tiny_hybrid_model  # noqa: E402


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def history(task: str, replies: list[str], turns: int) -> list[dict]:
    """The messages of turn ``turns`` (1-based) given the earlier ``replies``."""
    msgs = [
        {"role": "system", "content": system_prompt()},
        {"role": "user", "content": f"Task: fix {task}. {ASKS[0]}"},
    ]
    for i in range(1, turns):
        msgs += [
            {"role": "assistant", "content": f"Result: {replies[i - 1]}"},
            {"role": "user", "content": ASKS[i % len(ASKS)]},
        ]
    return msgs


def run_arch(arch: str, root: Path, args: argparse.Namespace) -> dict:
    model = make_tiny_hybrid_model(root / f"tiny-{arch}", arch)
    name = model.name
    servers = {}
    try:
        for label, env in (
            ("reuse", {}),
            ("no_reuse", {"MLXD_ENGINE__PREFIX_CACHE_BYTES": "0"}),
        ):
            home = root / f"home-{arch}-{label}"
            home.mkdir()
            servers[label] = mlxd_proc.start(str(home), str(model), env)
        rows = []
        with httpx.Client(timeout=600) as client:
            for pair in range(args.pairs):
                task = f"{TASKS[pair % len(TASKS)]} (case {pair})"
                replies: list[str] = []
                url = servers["reuse"][1]
                for t in range(1, args.turns):
                    _, text, _ = turn(client, url, name, history(task, replies, t), args.max_tokens)
                    replies.append(text)
                msgs = history(task, replies, args.turns)
                order = ["reuse", "no_reuse"] if pair % 2 == 0 else ["no_reuse", "reuse"]
                row: dict = {"pair": pair, "order": order}
                for label in order:
                    ttft, text, usage = turn(client, servers[label][1], name, msgs, args.max_tokens)
                    row[label] = {
                        "ttft": ttft,
                        "text": text,
                        "prompt_tokens": usage.get("prompt_tokens"),
                        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get(
                            "cached_tokens", 0
                        ),
                    }
                rows.append(row)
                print(
                    f"{arch} pair {pair}: reuse {row['reuse']['ttft']:.3f} s "
                    f"({row['reuse']['cached_tokens']}/{row['reuse']['prompt_tokens']} cached), "
                    f"no reuse {row['no_reuse']['ttft']:.3f} s",
                    flush=True,
                )
            health = client.get(servers["reuse"][1] + "/health").json()
    finally:
        for proc, _ in servers.values():
            mlxd_proc.stop(proc)
    (stats,) = [m["prefix_cache"] for m in health["models"] if m["name"] == name]
    reuse = [r["reuse"]["ttft"] for r in rows]
    cold = [r["no_reuse"]["ttft"] for r in rows]
    ratios = [c / w for w, c in zip(reuse, cold, strict=True)]
    return {
        "model": f"tests/fixtures/hybrid_models.py {arch}",
        "median_ttft_s": {"reuse": statistics.median(reuse), "no_reuse": statistics.median(cold)},
        "ttft_range_s": {"reuse": [min(reuse), max(reuse)], "no_reuse": [min(cold), max(cold)]},
        "speedup_median": statistics.median(ratios),
        "speedup_range": [min(ratios), max(ratios)],
        "median_prompt_tokens": statistics.median(r["reuse"]["prompt_tokens"] for r in rows),
        "median_cached_tokens": statistics.median(r["reuse"]["cached_tokens"] for r in rows),
        "greedy_text_identical": all(r["reuse"]["text"] == r["no_reuse"]["text"] for r in rows),
        "prefix_cache_stats": stats,
        "pairs": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", nargs="+", default=list(HYBRID_ARCHS), choices=HYBRID_ARCHS)
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out")
    args = ap.parse_args()
    results: dict[str, dict] = {}
    out = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": machine(),
        "python": platform.python_version(),
        "commit": commit(),
        "turn": args.turns,
        "pairs": args.pairs,
        "max_tokens": args.max_tokens,
        "results": results,
    }
    root = Path(tempfile.mkdtemp(prefix="mlxd-hybrid-agent-"))
    try:
        for arch in args.arch:
            results[arch] = run_arch(arch, root, args)
            if args.out:  # after each model: a run cut short keeps the models it finished
                Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{out['machine']}, commit {out['commit']}, {out['date']}")
    print(
        "| model | prompt tokens | cached | TTFT reuse (s) | TTFT no reuse (s) | speedup "
        "| greedy identical |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for arch, r in results.items():
        print(
            f"| {arch} | {r['median_prompt_tokens']:.0f} | {r['median_cached_tokens']:.0f} "
            f"| {r['median_ttft_s']['reuse']:.3f} | {r['median_ttft_s']['no_reuse']:.3f} "
            f"| {r['speedup_median']:.1f}x ({r['speedup_range'][0]:.1f}-"
            f"{r['speedup_range'][1]:.1f}) | {r['greedy_text_identical']} |"
        )


if __name__ == "__main__":
    main()
