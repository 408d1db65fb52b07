"""Does holding ~1 GiB of small MLX arrays (a full prefix cache) slow the decode steps? And
does inserting/evicting (the churn) do it?"""
import sys, time, statistics as st
sys.path.insert(0, "/work/main/benchmarks"); import resource
from mlxd import blas
blas.preload("auto")
import mlx.core as mx, numpy as np
from mlxd.engines.llm import LLMEngine
from mlxd.core.types import SamplingParams
import serve_bench
mode = sys.argv[1]
eng = LLMEngine("m", sys.argv[2], max_num_seqs=16, prefix_cache_bytes=(1 << 30) if mode == "churn" else 0, prefix_cache_min_tokens=64)
eng.bind(); eng.warmup()
held = []
if mode == "held":
    for i in range(185):
        held.append([mx.random.normal((1, 3, 160, 64)) for _ in range(60)])
        mx.eval(held[-1])
tok = eng.tokenizer
prompts = serve_bench.make_prompts(2000, 7, 8, 64)
ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts]
params = SamplingParams(max_tokens=64, temperature=0.0)
k = 0; live = set(); times = []; ru = []
import gc
gct = {"n": [0, 0, 0], "t": [0.0, 0.0, 0.0], "t0": 0.0}
def _cb(phase, info):
    if phase == "start": gct["t0"] = time.perf_counter()
    else:
        g = info["generation"]; gct["n"][g] += 1; gct["t"][g] += time.perf_counter() - gct["t0"]
gc.callbacks.append(_cb)
if len(sys.argv) > 4 and sys.argv[4] == "freeze": gc.collect(); gc.freeze()
t_end = time.perf_counter() + float(sys.argv[3])
while time.perf_counter() < t_end:
    while len(live) < 16:
        s = eng.new_sequence(list(ids[k]), params); k += 1; eng.add(s); live.add(s)
    t0 = time.perf_counter(); out = eng.step(); dt = time.perf_counter() - t0
    if len(times) % 50 == 0:
        r = resource.getrusage(resource.RUSAGE_SELF); ru.append((t0, r.ru_minflt, r.ru_utime, r.ru_stime, len(eng.prefix_cache)))
    times.append((t0, dt, eng.num_running))
    for s, ev in out:
        if ev.finish_reason is not None: live.discard(s)
import collections; print(collections.Counter(n for _, _, n in times).most_common(5)); full = [d for _, d, n in times if n >= 14]
n = len(full)
print(mode, "steps", len(times), "B=16 median ms", round(1000 * st.median(full), 1), "first half", round(1000*st.median(full[:n//2]),1), "second half", round(1000*st.median(full[n//2:]),1), "requests", k, "prefix entries", len(eng.prefix_cache))

for a, b in zip(ru, ru[1:]):
    print(f"t={a[0]-ru[0][0]:6.1f}s minflt/s={(b[1]-a[1])/(b[0]-a[0]):8.0f} user={(b[2]-a[2])/(b[0]-a[0]):.2f} sys={(b[3]-a[3])/(b[0]-a[0]):.2f} entries={b[4]}")

print("gc collections per generation", gct["n"], "seconds", [round(x, 2) for x in gct["t"]])
