"""Sample utime/stime/minflt/RSS of every mlxd engine core and of the engine-alone process."""
import os, time, sys, json
out = open(sys.argv[1], "w")
tck = os.sysconf("SC_CLK_TCK")
while True:
    rows = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
            if "mlxd.enginecore" in cmd:
                env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                side = "prefix-off" if b"MLXD_ENGINE__PREFIX_CACHE_BYTES=0" in env else "mlxd"
            elif "from mlx_lm.generate import BatchGenerator" in cmd:
                side = "engine"
            else:
                continue
            f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            rss = int(f[21]) * 4096
            rows.append({"side": side, "pid": int(pid), "minflt": int(f[7]), "majflt": int(f[9]),
                         "utime": int(f[11]) / tck, "stime": int(f[12]) / tck, "rss": rss})
        except OSError:
            continue
    out.write(json.dumps({"t": time.time(), "rows": rows}) + "\n"); out.flush()
    time.sleep(5)
