"""mlxd's text engine under a server's arrival pattern, without HTTP.

`serve_compare.py` measures the whole server, whose run-to-run spread on a shared GPU host
(+-20%) hides changes inside the engine core's steps. This drives `LLMEngine` directly,
the way the device worker does, with C closed-loop clients whose next request arrives a
random 5-30 ms after the previous one ended (an HTTP round trip, tokenizing, the wire),
so requests end and start a few at a time on most steps, as they do behind HTTP, instead
of in the aligned waves of an offline batch. Run it with two source trees on PYTHONPATH
in turn (A/B, alternating) to compare engine changes.

    PYTHONPATH=src python benchmarks/engine_arrivals.py --model-dir /tmp/q05 \
        --concurrency 16,64 --max-tokens 128 --seconds 15 --out a.json
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def run_level(engine, tok, c: int, seconds: float, max_tokens: int, seed: int) -> dict:
    import serve_bench

    from mlxd.core.types import SamplingParams

    rng = random.Random(seed)
    prompts = serve_bench.make_prompts(4 * c, seed, 8, 64)
    ids = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        for p in prompts
    ]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    due: list[float] = [time.perf_counter() + rng.uniform(0, 0.002) for _ in range(c)]
    live, tokens, done, steps, k = set(), 0, 0, 0, 0
    t_end = time.perf_counter() + seconds
    t0 = time.perf_counter()
    while True:
        now = time.perf_counter()
        if now >= t_end and not live:
            break
        while due and due[0] <= now and now < t_end:
            due.pop(0)
            seq = engine.new_sequence(list(ids[k % len(ids)]), params)
            k += 1
            engine.add(seq)
            live.add(seq)
        if engine.has_work():
            for seq, ev in engine.step():
                if ev.token is not None:
                    tokens += 1
                if ev.finish_reason is not None and seq in live:
                    live.discard(seq)
                    done += 1
                    due.append(time.perf_counter() + rng.uniform(0.005, 0.030))
                    due.sort()
            steps += 1
        else:
            time.sleep(0.0005)
    wall = time.perf_counter() - t0
    return {
        "concurrency": c,
        "tokens": tokens,
        "requests": done,
        "wall_s": wall,
        "output_tps": tokens / wall,
        "steps": steps,
        "ms_per_step": 1000 * wall / steps,
    }


CHILD = r"""
import json, sys
from mlxd import blas
blas.preload("auto")
sys.path.insert(0, sys.argv[2])
import engine_arrivals as ea
from mlxd.engines.llm import LLMEngine
a = json.loads(sys.argv[3])
eng = LLMEngine("m", sys.argv[1], max_num_seqs=max(a["levels"]), prefix_cache_bytes=a["prefix"],
                prefix_cache_min_tokens=64)
eng.bind()
eng.warmup()
out = []
for c in a["levels"]:
    ea.run_level(eng, eng.tokenizer, c, 3.0, a["max_tokens"], a["seed"] + 1)  # warm-up
    out.append(ea.run_level(eng, eng.tokenizer, c, a["seconds"], a["max_tokens"], a["seed"]))
print("RESULT " + json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefix-cache-bytes", type=int, default=1 << 30)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    params = {
        "levels": [int(x) for x in args.concurrency.split(",")],
        "seed": args.seed,
        "max_tokens": args.max_tokens,
        "seconds": args.seconds,
        "prefix": args.prefix_cache_bytes,
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            args.model_dir,
            str(Path(__file__).parent),
            json.dumps(params),
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    res = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[7:])
    for r in res:
        print(
            f"{args.label} C={r['concurrency']}: {r['output_tps']:.0f} tok/s, "
            f"{r['ms_per_step']:.2f} ms/step, {r['requests']} requests",
            flush=True,
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "command": " ".join(sys.argv),
                    "label": args.label,
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "results": res,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
