import sys, time, json
from mlxd import blas
blas.preload("auto")
sys.path.insert(0, "/work/main/benchmarks")
import engine_arrivals as ea
from mlxd.engines.llm import LLMEngine
pc = int(sys.argv[1])
eng = LLMEngine("m", "/tmp/cpuhome/models/smollm2-135m-instruct", max_num_seqs=16, prefix_cache_bytes=pc, prefix_cache_min_tokens=64, dtype="float32")
eng.bind(); eng.warmup()
for r in range(int(sys.argv[2])):
    res = ea.run_level(eng, eng.tokenizer, 16, 15.0, 64, 100 + r)
    st = eng.prefix_cache.stats()
    print(r, "%.1f tok/s %.1f ms/step" % (res["output_tps"], res["ms_per_step"]), st, flush=True)
