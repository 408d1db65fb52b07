import sys, json
from mlxd import blas
blas.preload("auto")
sys.path.insert(0, "/work/main/benchmarks")
import engine_arrivals as ea
import mlx.core as mx
from mlxd.engines.llm import LLMEngine
pc = int(sys.argv[1])
eng = LLMEngine("m", "/tmp/cpuhome/models/smollm2-135m-instruct", max_num_seqs=16, prefix_cache_bytes=pc, prefix_cache_min_tokens=64, dtype="float32")
eng.bind(); eng.warmup()
ea.run_level(eng, eng.tokenizer, 16, 5.0, 64, 1)
res = {"32MB": [], "1GiB": []}
for i, v in enumerate(["32MB", "1GiB"] * 3):
    mx.set_cache_limit(32 << 20 if v == "32MB" else 1 << 30)
    mx.clear_cache()
    out = ea.run_level(eng, eng.tokenizer, 16, 15.0, 64, 700 + i)
    res[v].append(round(out["output_tps"], 1)); print(v, res[v][-1], "peak MB", mx.get_peak_memory() >> 20, flush=True)
print(json.dumps(res))
