"""Decode throughput of the engine alone, in-process: mlx-lm's ``generate_step`` (one row),
mlx-lm's ``BatchGenerator``, and mlxd's ``LLMEngine`` with engine.pipeline_decode on and
off, in interleaved rounds (each round runs every mode once, in a rotated order, so a
machine whose speed drifts meets them all in about the same state).

``mlx_lm_batch_no_mask`` is mlx-lm's batch whose decode steps attend without the
left-padding mask (the prompts are of one length, so none is needed): what the mask costs;
``pipeline_on_masked`` is mlxd's engine with its maskless decode of unpadded batches off.

Each run prefills B 32-token prompts, then times greedy decode of --tokens tokens per row
(end-of-sequence ignored) from the first decoded token on; tok/s counts every row's tokens.
``--logprobs N`` has mlxd's rows ask for their logprobs and N top alternatives.
Needs only mlx, mlx-lm and mlxd (a CUDA or Metal machine: nothing else to install):

    PYTHONPATH=src python benchmarks/pipeline_decode.py --model DIR --batch 1,4,16 \
        --rounds 10 --tokens 128 --out result.json

Prints the JSON (every run, each mode's median, min, max and quartiles, and per-round
ratios against pipeline_decode off) to stdout and writes it to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlxd_proc  # noqa: E402

MODES = (
    "generate_step",
    "mlx_lm_batch",
    "mlx_lm_batch_no_mask",
    "pipeline_on",
    "pipeline_off",
    "pipeline_on_masked",
)


def prompts(batch: int) -> list[list[int]]:
    return [[1 + (7 * i + 3 * j + i * j) % 251 for j in range(32)] for i in range(batch)]


def run_generate_step(model: Any, batch: int, tokens: int) -> float:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    n, t0 = 0, 0.0
    for _tok, _lp in generate_step(mx.array(prompts(1)[0]), model, max_tokens=tokens + 1):
        if n == 0:
            t0 = time.perf_counter()
        n += 1
    return (n - 1) / (time.perf_counter() - t0)


def run_mlx_lm_batch(model: Any, batch: int, tokens: int, mask: bool = True) -> float:
    """``mask`` False: the batch's decode steps attend without the left-padding mask, which
    these equal-length prompts do not need (what a one-row fast path could skip)."""
    from mlx_lm.models.cache import BatchKVCache

    real = BatchKVCache.make_mask
    if not mask:
        BatchKVCache.make_mask = lambda self, n, **kw: None if n == 1 else real(self, n, **kw)
    try:
        return _batch_tps(model, batch, tokens)
    finally:
        BatchKVCache.make_mask = real


def _batch_tps(model: Any, batch: int, tokens: int) -> float:
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(
        model,
        stream=mx.default_stream(mx.default_device()),
        completion_batch_size=batch,
        prefill_batch_size=batch,
    )
    gen.insert(prompts(batch), max_tokens=[tokens + 1] * batch)
    seen: set[int] = set()
    n, t0 = 0, None
    while True:
        _, responses = gen.next()
        if t0 is not None:
            n += len(responses)
        seen.update(r.uid for r in responses)
        if t0 is None and len(seen) == batch:
            t0 = time.perf_counter()
        if responses and all(r.finish_reason for r in responses):
            break
    wall = time.perf_counter() - (t0 or 0.0)
    gen.close()
    return n / wall


def run_engine(
    engine: Any, batch: int, tokens: int, pipeline: bool, top: int, maskless: bool = True
) -> float:
    from mlxd.core.types import SamplingParams

    engine._gen._generation_batch.pipeline = pipeline
    engine._gen._generation_batch.maskless_decode = maskless
    params = SamplingParams(
        max_tokens=tokens + 1, temperature=0.0, logprobs=top >= 0, top_logprobs=max(top, 0)
    )
    seqs = [engine.new_sequence(p, params) for p in prompts(batch)]
    for seq in seqs:
        engine.add(seq)
    started: set[int] = set()
    n, t0 = 0, None
    while engine.has_work() or engine.num_waiting:
        if not engine.has_work():  # newcomers held for a burst to gather (GPU admission)
            time.sleep(0.001)
            continue
        out = engine.step()
        for _, o in out:
            if o.error is not None:
                raise RuntimeError(f"the engine failed a row: {o.error!r}") from o.error
        if t0 is not None:
            n += sum(1 for _, o in out if o.token is not None)
        started.update(id(s) for s, o in out if o.token is not None)
        if t0 is None and len(started) == batch:
            t0 = time.perf_counter()
    return n / (time.perf_counter() - (t0 or 0.0))


def summary(xs: list[float]) -> dict[str, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {
        "median": statistics.median(xs),
        "min": min(xs),
        "max": max(xs),
        "q1": q[0],
        "q3": q[2],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="an MLX model directory")
    ap.add_argument("--batch", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=128, help="decoded tokens per row per run")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument(
        "--logprobs", type=int, default=-1, help="mlxd's rows ask for logprobs, N top ones"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from mlxd import blas

    blas.preload("auto")
    import mlx.core as mx
    import mlx_lm

    from mlxd.engines.llm import LLMEngine
    from mlxd.engines.options import TextEngineOptions

    batches = [int(b) for b in args.batch.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    engine = LLMEngine("bench", Path(args.model), TextEngineOptions(max_num_seqs=max(batches)))
    engine.eos_token_ids = []  # every row decodes --tokens tokens (the batch reads these)
    engine.bind()

    def once(mode: str, batch: int) -> float | None:
        if mode == "generate_step":
            return run_generate_step(engine.model, batch, args.tokens) if batch == 1 else None
        if mode in ("mlx_lm_batch", "mlx_lm_batch_no_mask"):
            return run_mlx_lm_batch(engine.model, batch, args.tokens, mode == "mlx_lm_batch")
        return run_engine(
            engine,
            batch,
            args.tokens,
            mode != "pipeline_off",
            args.logprobs,
            maskless=mode != "pipeline_on_masked",
        )

    results: dict[str, Any] = {}
    for batch in batches:
        live = [m for m in modes if m != "generate_step" or batch == 1]
        for m in live:  # warm-up: compiled kernels, buffer cache
            once(m, batch)
        runs: dict[str, list[float]] = {m: [] for m in live}
        for r in range(args.rounds):
            order = live[r % len(live) :] + live[: r % len(live)]
            for m in order:
                tps = once(m, batch)
                assert tps is not None
                runs[m].append(tps)
            print(
                f"batch {batch} round {r}: " + ", ".join(f"{m} {runs[m][-1]:.1f}" for m in live),
                file=sys.stderr,
                flush=True,
            )
        entry: dict[str, Any] = {m: {**summary(v), "runs": v} for m, v in runs.items()}
        if "pipeline_off" in runs:
            base = runs["pipeline_off"]
            entry["ratio_to_pipeline_off"] = {
                m: summary([a / b for a, b in zip(v, base, strict=True)])
                for m, v in runs.items()
                if m != "pipeline_off"
            }
        results[str(batch)] = entry

    doc = {
        "benchmark": "pipeline_decode",
        "command": "python " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": mlxd_proc.commit(),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "device": str(mx.default_device()),
            "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__,
        },
        "model": str(args.model),
        "tokens_per_row": args.tokens,
        "logprobs": args.logprobs,
        "rounds": args.rounds,
        "unit": "decoded tokens/s, all rows",
        "results": results,
    }
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
