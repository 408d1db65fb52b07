import json, os, subprocess, sys
sys.path.insert(0, "/work/main/benchmarks")
import mlxd_proc
n, tag = int(sys.argv[1]), sys.argv[2]
env = dict(x.split("=", 1) for x in sys.argv[3:])
pp = "/tmp/s11/trace2:" + os.environ.get("PYTHONPATH", "")
p, url = mlxd_proc.start("/tmp/cpuhome", "smollm2-135m-instruct", {"PYTHONPATH": pp, "MEM_TRACE": f"/tmp/s11/{tag}", **env})
try:
    for r in range(n):
        out = f"/tmp/s11/{tag}-w{r}.json"
        subprocess.run([sys.executable, "/work/main/benchmarks/serve_bench.py", "--url", url, "--model", "smollm2-135m-instruct",
                        "--concurrency", "16", "--requests-per-client", "3", "--max-tokens", "64", "--seed", str(900 + r),
                        "--warmup", "0", "--out", out], stdout=subprocess.DEVNULL)
        d = json.load(open(out))["levels"][0]
        print(r, round(d["output_tps"], 1), flush=True)
finally:
    mlxd_proc.stop(p)
