"""Scratch: two servers side by side (A shipped, B prefix off), ABBA waves, each core step-traced."""
import json, os, subprocess, sys
sys.path.insert(0, "/work/main/benchmarks")
import mlxd_proc
n, c, mt = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
tag = sys.argv[4]
benv = dict(x.split("=", 1) for x in sys.argv[5:]) or {"MLXD_ENGINE__PREFIX_CACHE_BYTES": "0"}
pp = "/tmp/s11/trace:" + os.environ.get("PYTHONPATH", "")
srv = {"A": mlxd_proc.start("/tmp/cpuhome", "smollm2-135m-instruct", {"PYTHONPATH": pp, "STEP_TRACE": f"/tmp/s11/{tag}-A"}),
       "B": mlxd_proc.start("/tmp/cpuhome", "smollm2-135m-instruct", {"PYTHONPATH": pp, "STEP_TRACE": f"/tmp/s11/{tag}-B", **benv})}
res = {"A": [], "B": []}
try:
    seed = 500
    for r in range(n):
        for name in (["A", "B"] if r % 2 == 0 else ["B", "A"]):
            seed += 1
            out = f"/tmp/s11/{tag}-{name}-{r}.json"
            subprocess.run([sys.executable, "/work/main/benchmarks/serve_bench.py", "--url", srv[name][1],
                            "--model", "smollm2-135m-instruct", "--concurrency", str(c), "--requests-per-client", "3",
                            "--max-tokens", str(mt), "--seed", str(seed), "--warmup", "0", "--out", out], stdout=subprocess.DEVNULL)
            d = json.load(open(out))["levels"][0]
            res[name].append((round(d["output_tps"], 1), round(d["itl_p50"] * 1000), round(d["ttft_p50"] * 1000)))
            print(r, name, res[name][-1], flush=True)
finally:
    for p, _ in srv.values():
        mlxd_proc.stop(p)
json.dump(res, open(f"/tmp/s11/{tag}.json", "w"))
