import sys, json, gc
from mlxd import blas
blas.preload("auto")
sys.path.insert(0, "/work/main/benchmarks")
import engine_arrivals as ea
import mlx.core as mx
from mlxd.engines.llm import LLMEngine
eng = LLMEngine("m", "/tmp/cpuhome/models/smollm2-135m-instruct", max_num_seqs=16, prefix_cache_bytes=0, dtype="float32")
eng.bind(); eng.warmup()
ea.run_level(eng, eng.tokenizer, 16, 5.0, 64, 1)
res = {"free": [], "hold": []}
held = []
for i, v in enumerate(["free", "hold"] * 3):
    held = []
    gc.collect(); mx.clear_cache()
    if v == "hold":
        # what a full prefix cache holds: ~200 entries x 60 arrays of ~90 KB
        held = [mx.zeros((1, 3, 120, 64)) + k for k in range(12000)]
        mx.eval(held)
    out = ea.run_level(eng, eng.tokenizer, 16, 15.0, 64, 700 + i)
    res[v].append(round(out["output_tps"], 1)); print(v, res[v][-1], "active MB", mx.get_active_memory() >> 20, flush=True)
print(json.dumps(res))
