"""Scratch: C=16 waves against one server; per wave core minflt/majflt, cpu, threads, tier bytes."""
import json, os, subprocess, sys, time, re
sys.path.insert(0, "/work/main/benchmarks")
import mlxd_proc, httpx

def stat(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    # fields after ')' : state=0 ... minflt=7 majflt=9 utime=11 stime=12 threads=17
    return dict(minflt=int(f[7]), majflt=int(f[9]), ut=int(f[11]) / 100, st=int(f[12]) / 100, thr=int(f[17]))

def rss(pid):
    for l in open(f"/proc/{pid}/status"):
        if l.startswith("VmRSS"): return int(l.split()[1]) // 1024

def children(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(x) for x in out]

env = {}
if len(sys.argv) > 2: env["MLXD_ENGINE__PREFIX_CACHE_BYTES"] = sys.argv[2]
proc, url = mlxd_proc.start("/tmp/cpuhome", "smollm2-135m-instruct", env)
kids = children(proc.pid)
core = [k for k in kids if "enginecore" in open(f"/proc/{k}/cmdline").read()] or kids
core = core[0]
print("server", proc.pid, "core", core, open(f"/proc/{core}/cmdline").read().replace("\0", " ")[:120], flush=True)
res = []
try:
    for wave in range(int(sys.argv[1])):
        s0 = stat(core); t0 = time.time()
        r = subprocess.run([sys.executable, "/work/main/benchmarks/serve_bench.py", "--url", url,
                            "--model", "smollm2-135m-instruct", "--concurrency", "16",
                            "--requests-per-client", "3", "--max-tokens", "64", "--seed", str(100 + wave),
                            "--warmup", "0", "--out", f"/tmp/s10/w{wave}.json"], capture_output=True, text=True)
        s1 = stat(core); dt = time.time() - t0
        m = httpx.get(url + "/metrics").text
        tier = [l for l in m.splitlines() if "prefix" in l and "bytes" in l and not l.startswith("#")]
        d = json.load(open(f"/tmp/s10/w{wave}.json"))
        lvl = d["levels"][0]
        row = dict(wave=wave, dt=round(dt, 1), minflt=s1["minflt"] - s0["minflt"], majflt=s1["majflt"] - s0["majflt"],
                   ut=round(s1["ut"] - s0["ut"], 1), st=round(s1["st"] - s0["st"], 1), thr=s1["thr"], rss=rss(core),
                   tier=[t.split()[-1] for t in tier][:3], tps=round(lvl["output_tps"],1), itl=round(lvl["itl_p50"]*1000), ttft=round(lvl["ttft_p50"]*1000))
        print(row, flush=True); res.append(row)
finally:
    mlxd_proc.stop(proc)
json.dump(res, open(f"/tmp/s10/faults-{sys.argv[2] if len(sys.argv)>2 else 'shipped'}.json", "w"))
