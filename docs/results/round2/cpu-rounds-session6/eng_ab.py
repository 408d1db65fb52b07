import sys, time, json, gc
from mlxd import blas
blas.preload("auto")
sys.path.insert(0, "/work/main/benchmarks")
import engine_arrivals as ea
import mlx.core as mx
from mlxd.engines.llm import LLMEngine
from mlxd.engines.prefix_cache import PrefixCache
eng = LLMEngine("m", "/tmp/cpuhome/models/smollm2-135m-instruct", max_num_seqs=16, prefix_cache_bytes=1<<30, prefix_cache_min_tokens=64, dtype="float32")
eng.bind(); eng.warmup()
r = 0
while eng.prefix_cache.nbytes < (1 << 30) * 0.9:
    ea.run_level(eng, eng.tokenizer, 16, 10.0, 64, 500 + r); r += 1
print("filled", eng.prefix_cache.stats(), flush=True)
full = eng.prefix_cache
empty = PrefixCache(0, 64)
res = {"A-full-active": [], "B-full-held-unused": [], "C-none": []}
order = ["A-full-active", "B-full-held-unused"] * 3
for i, v in enumerate(order):
    eng.prefix_cache = full if v.startswith("A") else empty
    out = ea.run_level(eng, eng.tokenizer, 16, 15.0, 64, 900 + i)
    res[v].append(round(out["output_tps"], 1))
    print(v, res[v][-1], flush=True)
full.clear(); del full; gc.collect(); mx.clear_cache()
eng.prefix_cache = empty
for i in range(3):
    out = ea.run_level(eng, eng.tokenizer, 16, 15.0, 64, 950 + i)
    res["C-none"].append(round(out["output_tps"], 1)); print("C-none", res["C-none"][-1], flush=True)
print(json.dumps(res))
