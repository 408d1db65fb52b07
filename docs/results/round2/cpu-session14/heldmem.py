import sys, time, statistics as st
from mlxd import blas
blas.preload("auto")
import mlx.core as mx
from mlx_lm.utils import load
from mlx_lm.generate import BatchGenerator
model, tok = load(sys.argv[1])
model.apply(lambda x: x.astype(mx.float32) if x.dtype in (mx.float16, mx.bfloat16) else x)
held = []
mode = sys.argv[2]
def run(tag):
    prompts = [tok.encode(f"tell me a story number {i} about dragons and knights " * 20)[:300] for i in range(16)]
    g = BatchGenerator(model, max_tokens=60, completion_batch_size=16, prefill_batch_size=16)
    g.insert(prompts, max_tokens=[60]*16)
    ts = []
    n = 0
    while n < 16:
        t = time.perf_counter()
        rs = g.next_generated()
        dt = time.perf_counter() - t
        if len(rs) == 16: ts.append(dt * 1e3)
        n += sum(1 for r in rs if r.finish_reason is not None)
    g.close()
    print(tag, "B=16 decode median %.1f ms (n=%d)" % (st.median(ts), len(ts)), flush=True)
run("warm")
for rnd in range(3):
    if mode == "held" and rnd >= 1:
        # ~1 GiB in arrays shaped like a prefix tier's KV entries (30 layers x 2 x [1,3,300,64] f32)
        while sum(a.nbytes for a in held) < (1 << 30):
            ks = [mx.random.normal((1, 3, 300, 64)) for _ in range(60)]
            mx.eval(ks); held.extend(ks)
    run(f"{mode} round {rnd} held {sum(a.nbytes for a in held) >> 20} MiB")
