"""Where the time goes across the process boundary, under a steady load.

Starts ``mlxd serve`` (``--api-workers N``), drives it with serve_bench at concurrency C for
long enough to reach a steady state, then, for WINDOW seconds in the middle of the load:

* CPU seconds per second of every process (the serving/front-end processes and the engine
  core) from /proc, so "is the front end saturated?" is one number;
* the server-side generated tokens per second (from /metrics);
* py-spy (without --idle: only samples where a thread runs) of the front end(s) and the core,
  saved raw, and each thread's busy fraction (samples / (rate x window)).

    python benchmarks/profile_split.py --model-dir DIR --concurrency 64 --api-workers 1 \
        --window 10 --out OUTDIR
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).parent


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def gen_tokens(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("mlxd:generation_tokens_total")
    )


def busy_by_thread(raw: Path, rate: int, window: float) -> dict[str, float]:
    counts: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        if not line.strip():
            continue
        stack, n = line.rsplit(" ", 1)
        frames = stack.split(";")
        thread = next((f for f in frames if f.startswith("thread")), "?")
        counts[thread] += int(n)
    return {t: round(c / (rate * window), 3) for t, c in counts.most_common()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--api-workers", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests-per-client", type=int, default=40)
    ap.add_argument("--window", type=float, default=10.0)
    ap.add_argument("--warm", type=float, default=6.0, help="seconds of load before measuring")
    ap.add_argument("--rate", type=int, default=200)
    ap.add_argument("--port", type=int, default=8799)
    ap.add_argument(
        "--pyspy-args",
        default="",
        help="more py-spy record flags, e.g. '--idle --native' (where each "
        "thread waits) or '--gil' (who holds the GIL)",
    )
    ap.add_argument("--mlxd-args", default="", help="extra mlxd serve arguments")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{a.port}"
    log = open(out / f"server-w{a.api_workers}-c{a.concurrency}.log", "w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlxd",
            "serve",
            "--model",
            a.model_dir,
            "--port",
            str(a.port),
            "--max-num-seqs",
            str(max(a.concurrency, 8)),
            "--log-level",
            "warning",
            "--api-workers",
            str(a.api_workers),
            *a.mlxd_args.split(),
        ],
        stdout=log,
        stderr=log,
        # a disk tier of its own: another run's prefixes (same seeded prompts) would be hits
        env={
            "MLXD_ENGINE__PREFIX_CACHE_DIR": tempfile.mkdtemp(prefix="mlxd-prefix-"),
            **os.environ,
        },
    )
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        bench = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "serve_bench.py"),
                "--url",
                url,
                "--model",
                Path(a.model_dir).name,
                "--concurrency",
                str(a.concurrency),
                "--requests-per-client",
                str(a.requests_per_client),
                "--max-tokens",
                str(a.max_tokens),
                "--out",
                str(out / f"bench-w{a.api_workers}-c{a.concurrency}.json"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        time.sleep(a.warm)
        kids = children(server.pid)
        core = [p for p in kids if "mlxd.enginecore" in Path(f"/proc/{p}/cmdline").read_text()]
        fronts = [server.pid] + [p for p in kids if p not in core]
        procs = {
            "serve": server.pid,
            **{f"front-{p}": p for p in fronts[1:]},
            **{f"core-{p}": p for p in core},
        }
        c0 = {k: cpu_seconds(p) for k, p in procs.items()}
        g0, t0 = gen_tokens(url), time.perf_counter()
        spies = [
            subprocess.Popen(
                [
                    "py-spy",
                    "record",
                    "-p",
                    str(p),
                    "-d",
                    str(int(a.window)),
                    "-r",
                    str(a.rate),
                    "-f",
                    "raw",
                    "--threads",
                    # py-spy walks native stacks only of a paused process
                    *([] if "--native" in a.pyspy_args else ["--nonblocking"]),
                    *a.pyspy_args.split(),
                    "-o",
                    str(out / f"pyspy-{k}.txt"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for k, p in procs.items()
            if k != "serve" or a.api_workers == 1
        ]
        for s in spies:
            s.wait()
        dt = time.perf_counter() - t0
        g1 = gen_tokens(url)
        c1 = {k: cpu_seconds(p) for k, p in procs.items()}
        report = {
            "api_workers": a.api_workers,
            "concurrency": a.concurrency,
            "window_s": dt,
            "server_gen_tps": (g1 - g0) / dt,
            "cpu_per_s": {k: round((c1[k] - c0[k]) / dt, 3) for k in procs},
            "busy_by_thread": {
                k: busy_by_thread(out / f"pyspy-{k}.txt", a.rate, a.window)
                for k in procs
                if (out / f"pyspy-{k}.txt").exists()
            },
        }
        print(json.dumps(report, indent=1))
        (out / f"split-w{a.api_workers}-c{a.concurrency}.json").write_text(
            json.dumps(report, indent=1)
        )
        bench.terminate()  # the measurement is taken; the rest of the load is not needed
        bench.wait(60)
    finally:
        server.terminate()
        server.wait(60)
        log.close()


if __name__ == "__main__":
    main()
