"""What one forward pass costs against two: decode rows alone, a prompt chunk alone, the two
as separate passes in turn (as a step without engine.mixed_steps runs them), and the two in
one mixed pass (engines/mixed_step.py).

    PYTHONPATH=src python benchmarks/mixed_pass.py --chunks 32,64,128,512 --out mixed.json
    PYTHONPATH=src python benchmarks/mixed_pass.py \\
        --model-dir ~/.mlxd/models/smollm2-135m-instruct --chunks 32,64 --out mixed.json

Without ``--model-dir`` it writes the long-prompt benchmark's tiny random model. Each
measurement is the median of ``--reps`` timed runs, the four kinds interleaved; caches
hold ``--context`` tokens per row and are trimmed back after every run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlxd_proc  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir")
    ap.add_argument("--rows", type=int, default=8, help="decode rows")
    ap.add_argument("--chunks", default="32,64,128,512")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out")
    args = ap.parse_args()

    from mlxd import blas

    info = blas.preload("auto")  # before MLX, as the engine core does
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache
    from mlx_lm.utils import load

    from mlxd.engines.mixed_step import mixed_forward

    tmp = tempfile.TemporaryDirectory(prefix="mixed-pass-")
    model_dir = args.model_dir
    if model_dir is None:
        from make_random_model import write_random_model

        model_dir = str(Path(tmp.name) / "tiny")
        write_random_model("qwen2.5-vocab-tiny", "float32", Path(model_dir))
    model, _ = load(model_dir)
    layers = len(model.layers)

    def caches(rows: int) -> list:
        c = [BatchKVCache([0] * rows) for _ in range(layers)]
        model(mx.random.randint(100, 5000, (rows, args.context)), cache=c)
        mx.eval([x.state for x in c])
        return c

    dec, pro = caches(args.rows), caches(1)

    def tokens(rows: int, n: int) -> mx.array:
        return mx.random.randint(100, 5000, (rows, n))

    def decode() -> None:
        mx.eval(model(tokens(args.rows, 1), cache=dec)[:, -1, :], [c.state for c in dec])

    def prefill(n: int) -> None:
        model.model(tokens(1, n), cache=pro)  # a prefill chunk's logits are never read
        mx.eval([c.state for c in pro])

    def mixed(n: int) -> None:
        uids = list(range(args.rows))
        logits, _ = mixed_forward(
            model, tokens(args.rows, 1), dec, uids, tokens(1, n), pro, [args.rows], False
        )
        mx.eval(logits, [c.state for c in dec + pro])

    results = {}
    for n in (int(c) for c in args.chunks.split(",")):
        kinds = {
            "decode": decode,
            "prefill": lambda n=n: prefill(n),
            "both_in_turn": lambda n=n: (decode(), prefill(n)),
            "mixed": lambda n=n: mixed(n),
        }
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for rep in range(args.reps + 1):
            for kind, fn in kinds.items():
                tic = time.perf_counter()
                fn()
                if rep:  # the first round warms up
                    times[kind].append(time.perf_counter() - tic)
                for c in dec:
                    c.trim(c._idx - args.context)
                for c in pro:
                    c.trim(c._idx - args.context)
        med = {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}
        results[n] = {"median_ms": med, "mixed_over_in_turn": med["mixed"] / med["both_in_turn"]}
        print(f"chunk {n}: " + ", ".join(f"{k} {v} ms" for k, v in med.items()), flush=True)
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "command": sys.argv,
                    "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    "commit": mlxd_proc.commit(),
                    "model_dir": args.model_dir or "qwen2.5-vocab-tiny (random, float32)",
                    "blas": f"{info.name} {info.version}",
                    "rows": args.rows,
                    "context": args.context,
                    "reps": args.reps,
                    "chunks": results,
                },
                indent=2,
            )
        )
    tmp.cleanup()


if __name__ == "__main__":
    main()
