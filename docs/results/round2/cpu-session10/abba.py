"""Scratch: two servers (shipped, prefix off) side by side, ABBA waves of C=16."""
import json, subprocess, sys, time
sys.path.insert(0, "/work/main/benchmarks")
import mlxd_proc
n = int(sys.argv[1])
srv = {"shipped": mlxd_proc.start("/tmp/cpuhome", "smollm2-135m-instruct", {}),
       "off": mlxd_proc.start("/tmp/cpuhome", "smollm2-135m-instruct", {"MLXD_ENGINE__PREFIX_CACHE_BYTES": "0"})}
res = {"shipped": [], "off": []}
try:
    seed = 100
    for r in range(n):
        order = ["shipped", "off"] if r % 2 == 0 else ["off", "shipped"]
        for name in order:
            seed += 1
            out = f"/tmp/s10/abba-{name}-{r}.json"
            subprocess.run([sys.executable, "/work/main/benchmarks/serve_bench.py", "--url", srv[name][1],
                            "--model", "smollm2-135m-instruct", "--concurrency", "16", "--requests-per-client", "3",
                            "--max-tokens", "64", "--seed", str(seed), "--warmup", "0", "--out", out], stdout=subprocess.DEVNULL)
            d = json.load(open(out))["levels"][0]
            res[name].append((round(d["output_tps"], 1), round(d["itl_p50"] * 1000), round(d["ttft_p50"] * 1000)))
            print(r, name, res[name][-1], flush=True)
finally:
    for p, _ in srv.values():
        mlxd_proc.stop(p)
json.dump(res, open("/tmp/s10/abba.json", "w"))
