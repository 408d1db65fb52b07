"""What a new attention shape costs on MLX's CUDA backend, with and without cuDNN's fused
attention (``MLX_CUDA_USE_CUDNN_SDPA``).

MLX's CUDA backend runs attention over more than one query position (prefill, a
speculative verify step) through cuDNN, whose execution graph it builds once per exact
(batch, heads, query length, key length, strides) and keeps in an LRU of 256
(``MLX_CUDA_SDPA_CACHE_SIZE``). A server's prompts all have different lengths, so most
prefills meet a shape for the first time. This times the same forward passes twice, a
shape's first contact and its repeat, in a child process per setting:

- prefill of one prompt (and of a batch of 8) at several lengths, first and second time;
- a long prompt in 512-token chunks (where a fused kernel should pay most);
- speculative verify steps: 5 query positions against a KV cache one token longer each step;
- plain decode steps at batch 16 (one query position: no cuDNN graph either way).

    python benchmarks/attention_shapes.py --model-dir /tmp/q05 --out attention_shapes.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
import mlx.core as mx
from mlx_lm.utils import load
from mlx_lm.models.cache import make_prompt_cache

model, tok = load(sys.argv[1])
vocab = model.args.vocab_size if hasattr(model, "args") else 32000
rng = __import__("random").Random(0)


def ids(b, n):
    return mx.array([[rng.randrange(256, vocab - 1) for _ in range(n)] for _ in range(b)])


def prefill(b, n, chunk=512):
    cache = make_prompt_cache(model)
    x = ids(b, n)
    mx.synchronize()
    t0 = time.perf_counter()
    while x.shape[1]:
        model(x[:, :chunk], cache=cache)
        mx.eval([c.state for c in cache])
        x = x[:, chunk:]
    mx.synchronize()
    return (time.perf_counter() - t0) * 1000, cache


out = {"device": str(mx.default_device())}
prefill(1, 33)  # load kernels, handles
rows = []
for b, n in [(1, 97), (1, 97), (1, 98), (1, 98), (1, 211), (1, 211), (1, 350), (1, 350),
             (8, 120), (8, 120), (8, 121), (8, 121)]:
    ms, _ = prefill(b, n)
    rows.append({"batch": b, "tokens": n, "ms": round(ms, 2)})
out["prefill"] = rows
rows = []
for n in (4096, 4096, 8192, 8192):
    ms, _ = prefill(1, n)
    rows.append({"batch": 1, "tokens": n, "ms": round(ms, 2)})
out["long_prefill"] = rows


# n forward passes of `positions` new tokens per row, each timed; with `keep`, the cache is
# cut back after each pass to `keep` of them (a verify step's accepted run)
def steps(cache, batch, positions, n, keep=None):
    times = []
    for _ in range(n):
        x = ids(batch, positions)
        mx.synchronize()
        t0 = time.perf_counter()
        model(x, cache=cache)
        mx.eval([c.state for c in cache])
        times.append(round((time.perf_counter() - t0) * 1000, 2))
        if keep is not None:
            for c in cache:
                c.trim(positions - keep)
    return times


# verify steps: 5 positions against a cache that grows by one accepted token per step
out["verify_5_ms"] = steps(prefill(1, 300)[1], 1, 5, 24, keep=1)
# decode at batch 16
out["decode_b16_ms"] = steps(prefill(16, 200)[1], 16, 1, 40)
print("RESULT " + json.dumps(out))
"""


def run(model_dir: str, cudnn: str) -> dict:
    env = dict(os.environ, MLX_CUDA_USE_CUDNN_SDPA=cudnn)
    p = subprocess.run(
        [sys.executable, "-c", CHILD, model_dir],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-3000:])
    line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[7:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res = {
        "command": " ".join(sys.argv),
        "machine": f"{platform.node()} {os.cpu_count()} cpus",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    for name, val in (("cudnn_on", "1"), ("cudnn_off", "0")):
        res[name] = run(args.model_dir, val)
        r = res[name]
        print(
            f"{name}: prefill "
            + ", ".join(f"{x['batch']}x{x['tokens']}={x['ms']}" for x in r["prefill"])
        )
        print(f"{name}: long " + ", ".join(f"{x['tokens']}={x['ms']}" for x in r["long_prefill"]))
        v, d = r["verify_5_ms"], r["decode_b16_ms"]
        print(
            f"{name}: verify first 6 {v[:6]} median {sorted(v)[len(v) // 2]}; "
            f"decode b16 median {sorted(d)[len(d) // 2]}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
