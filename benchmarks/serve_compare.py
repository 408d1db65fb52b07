"""mlxd vs mlx_lm.server vs the engine alone, on the same model directory, in one run.

    python benchmarks/serve_compare.py --model-dir DIR [--concurrency 1,4,16,32] \
        [--max-tokens 64] [--requests-per-client 3] [--out results.json]

- engine: mlx-lm's BatchGenerator without HTTP (at most C sequences in flight, the same
  prompts through the same chat template), loaded after the same BLAS preload mlxd does;
  the loop is ``mlxd bench --peer engine``'s (mlxd.bench.engine_alone.closed_loop).
- mlxd: `python -m mlxd serve --model DIR`.
- mlx_lm.server as shipped (`python -m mlx_lm.server --model DIR`); with --mlx-lm-blas also
  a second run of it with the BLAS mlxd picked preloaded (LD_PRELOAD), to separate what
  comes from the BLAS from what comes from the server.
Ratios are computed against the engine and against mlx_lm.server from the same run.

``--rounds N`` (engine and mlxd only) alternates the two N times on fresh prompts per round,
mlxd's server staying up: engine, mlxd, engine, mlxd, ... and reports each
level's median ratio over the rounds. On a host whose CPU speed changes from minute to
minute (an H200 VM: the same engine's decode step took 7 or 11.5 ms depending on when it
ran) one engine run and one mlxd run minutes apart compare the host's
moods as much as the two programs.

``--interleave K`` goes further: the engine alone stays loaded in a process of its own
beside the running server, and per level K pairs of passes alternate them seconds apart
(ABBA order, fresh prompts per pair, the same prompts for both sides of a pair); each
level reports the median of its K ratios, of the TTFT p50 differences and of the ITL p95
ratios. ``--also-api-workers N`` adds a second server with ``--api-workers N`` as a third
side of every pair; each ``--also-env NAME:VAR=VALUE[,VAR=VALUE...]`` adds a server with
those settings (``MLXD_*`` variables, or a ``PYTHONPATH`` naming another tree's ``src``)
as one more side, so that variants meet the host in the same pairs as the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import serve_bench  # noqa: E402
from line_process import LineProcess  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, path: str, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(url)


@contextlib.contextmanager
def serving(cmd: list[str], env: dict, args, health: str):
    """A server started for the block; yields its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(Path(args.logdir) / f"{cmd[2].replace('.', '_')}-{port}.log", "w")
    proc = subprocess.Popen(cmd + ["--port", str(port)], env=env, stdout=log, stderr=log)
    try:
        wait_healthy(url, proc, health)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def bench_server(cmd: list[str], env: dict, model: str, args, health: str) -> list[dict]:
    with serving(cmd, env, args, health) as url:
        return measure_server(url, model, args, args.seed)


def measure_server(url: str, model: str, args, seed: int) -> list[dict]:
    """Every level against a running server: a warm-up pass, then the measured one."""
    levels = []
    for c in args.levels:
        # warm-up, as the engine gets: the same workload with other prompts
        warm_seed, seed_c = serve_bench.level_seeds(seed, c)
        warm_server(url, model, args, c, warm_seed)
        r = server_pass(url, model, args, c, seed_c)
        print(
            f"  C={c}: {r['output_tps']:.1f} tok/s, ttft p50 {r['ttft_p50']:.3f}s, "
            f"errors {r['errors']}",
            flush=True,
        )
        levels.append(r)
    return levels


def warm_server(url: str, model: str, args, c: int, seed: int) -> None:
    if args.short_warmup:  # no kernel compilation on the CPU: warm up briefly
        server_pass(url, model, args, c, seed, per_client=1, max_tokens=8, measured=False)
    else:
        server_pass(url, model, args, c, seed, measured=False)


def server_pass(
    url: str,
    model: str,
    args,
    c: int,
    seed: int,
    *,
    per_client: int | None = None,
    max_tokens: int | None = None,
    measured: bool = True,
) -> dict:
    """One closed-loop pass of C clients against a running server."""
    per_client = per_client or args.requests_per_client
    max_tokens = max_tokens or args.max_tokens
    measured = measured and getattr(args, "metrics", False)
    before = _ttft_parts(url) if measured else {}
    if args.client_procs > 1:
        r = serve_bench.run_level_procs(
            url,
            model,
            c,
            per_client,
            max_tokens,
            seed,
            args.min_words,
            args.max_words,
            args.client_procs,
        )
    else:
        r = asyncio.run(
            serve_bench.run_level(
                url, model, c, per_client, max_tokens, seed, args.min_words, args.max_words
            )
        )
    if measured:
        r["server_side"] = _diff_parts(before, _ttft_parts(url))
    return r


# Where a request's time to first token goes, from the server's own histograms (sums and
# counts, so a level's mean is the difference of two snapshots): queue = arrival in the engine
# -> joining a batch; ttft = the server's time to first token.
_PARTS = (
    "mlxd:request_queue_time_seconds",
    "mlxd:time_to_first_token_seconds",
    "mlxd:e2e_request_latency_seconds",
)


def _ttft_parts(url: str) -> dict[str, tuple[float, float]]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        for name in _PARTS:
            for suffix, idx in (("_sum", 0), ("_count", 1)):
                if line.startswith(name + suffix):
                    out.setdefault(name, [0.0, 0.0])[idx] += float(line.split()[-1])
    return {k: (v[0], v[1]) for k, v in out.items()}


def _diff_parts(a: dict, b: dict) -> dict[str, float | None]:
    res = {}
    for name in _PARTS:
        (s0, n0), (s1, n1) = a.get(name, (0.0, 0.0)), b.get(name, (0.0, 0.0))
        res[name.split(":", 1)[1] + "_mean"] = (s1 - s0) / (n1 - n0) if n1 > n0 else None
    return res


ENGINE = r"""
import json, sys, time
from mlxd import blas
blas.preload("auto")
import mlx.core as mx
from mlx_lm.utils import load
from mlxd.bench.engine_alone import closed_loop, encode
sys.path.insert(0, sys.argv[2])
import serve_bench
a = json.loads(sys.argv[3])
model, tok = load(sys.argv[1])
if mx.default_device() == mx.cpu:
    # the server's dtype policy on CPU: float32
    model.apply(lambda x: x.astype(mx.float32) if x.dtype in (mx.float16, mx.bfloat16) else x)
out = []
stream = mx.default_stream(mx.default_device())


def level(c, per_client, max_tokens, seed):
    prompts = serve_bench.make_prompts(c * per_client, seed, a["min_words"], a["max_words"])
    ids = [encode(tok, p) for p in prompts]
    # mlxd bench's engine-alone loop: client i's next prompt inserted when its row ends
    seen, t_submit, wall = closed_loop(model, tok, ids, c, max_tokens, stream)
    tokens = sum(len(rows) for rows in seen.values())
    # TTFT and inter-token gaps as a streaming client sees them (serve_bench): at the tokens
    # that make text visible, found by replaying the detokenizer after the run (no cost
    # inside the loop). A byte-level token that completes no character shows nothing.
    ttft, ttft_tok, gaps, dec = [], [], [], []
    for u, rows in seen.items():
        d = tok.detokenizer
        stamps = []
        for t, at, fin in rows:
            if fin == "stop":
                d.finalize()
            else:
                d.add_token(t)
                if fin is not None:
                    d.finalize()
            if d.last_segment:
                stamps.append(at)
        ttft_tok.append(rows[0][1] - t_submit[u])
        if stamps:
            ttft.append(stamps[0] - t_submit[u])
            gaps += [b - a for a, b in zip(stamps, stamps[1:])]
        if len(rows) > 1 and rows[-1][1] > rows[0][1]:
            dec.append((len(rows) - 1) / (rows[-1][1] - rows[0][1]))
    for xs in (ttft, ttft_tok, gaps, dec):
        xs.sort()
    pct = lambda xs, q: xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else None
    return {"concurrency": c, "output_tokens": tokens, "wall_s": wall,
            "output_tps": tokens / wall, "ttft_p50": pct(ttft, 50), "ttft_p95": pct(ttft, 95),
            "ttft_first_token_p50": pct(ttft_tok, 50),
            "itl_p50": pct(gaps, 50), "itl_p95": pct(gaps, 95),
            "decode_tps_per_request": dec[len(dec) // 2] if dec else None}


if a.get("interactive"):  # --interleave: one level per line on stdin, one RESULT line each
    print("READY", flush=True)
    for line in sys.stdin:
        q = json.loads(line)
        print("RESULT " + json.dumps(level(q["c"], q["per_client"], q["max_tokens"],
                                           q["seed"])), flush=True)
    sys.exit(0)
for c in a["levels"]:
    # warm-up: the same workload with other prompts (kernels compile per shape); every
    # level and pass has prompts of its own, as for the servers
    warm_seed, seed_c = serve_bench.level_seeds(a["seed"], c)
    if a["short_warmup"]:
        level(c, 1, 8, warm_seed)
    else:
        level(c, a["per_client"], a["max_tokens"], warm_seed)
    out.append(level(c, a["per_client"], a["max_tokens"], seed_c))
    print(json.dumps(out[-1]), flush=True)
print("RESULT " + json.dumps(out))
"""


def _engine_run(args, seed: int, **extra) -> tuple[list[str], dict]:
    """The engine-alone script's command line and environment."""
    params = {
        "levels": args.levels,
        "per_client": args.requests_per_client,
        "seed": seed,
        "min_words": args.min_words,
        "max_words": args.max_words,
        "max_tokens": args.max_tokens,
        "short_warmup": args.short_warmup,
        **extra,
    }
    env = dict(os.environ)
    for kv in filter(None, args.engine_env.split(",")):
        k, _, v = kv.partition("=")
        env[k] = v
    return [
        sys.executable,
        "-c",
        ENGINE,
        args.model_dir,
        str(Path(__file__).parent),
        json.dumps(params),
    ], env


def bench_engine(args, seed: int | None = None) -> list[dict]:
    cmd, env = _engine_run(args, args.seed if seed is None else seed)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[7:])


def run_interleaved(
    args, skip: set, sides: dict[str, tuple[list[str], dict]], name: str
) -> list[dict]:
    """Every side loaded at once (the engine alone in a process of its own, each server
    up), then per level: a warm-up pass each, and K pairs of passes, the sides' order
    reversed every other pair (ABBA), each pair on prompts of its own. A pass lasts seconds,
    so the two sides of a pair meet the host in the same mood, where --rounds puts minutes
    between them."""
    out: list[dict] = []
    with contextlib.ExitStack() as stack:
        urls = {
            k: stack.enter_context(serving(cmd, env, args, "/health"))
            for k, (cmd, env) in sides.items()
        }
        engine = None
        if "engine" not in skip:
            # the engine alone kept loaded, one level per request (ENGINE's interactive mode)
            engine = LineProcess(*_engine_run(args, args.seed, interactive=True))
            stack.callback(engine.close)

        def one(side: str, c: int, seed: int, warm: bool = False) -> dict:
            if side == "engine":
                short = warm and args.short_warmup
                return engine.ask(
                    {
                        "c": c,
                        "seed": seed,
                        "per_client": 1 if short else args.requests_per_client,
                        "max_tokens": 8 if short else args.max_tokens,
                    }
                )
            if warm:
                warm_server(urls[side], name, args, c, seed)
                return {}
            return server_pass(urls[side], name, args, c, seed)

        order = (["engine"] if engine is not None else []) + list(urls)
        for c in args.levels:
            warm_seed, seed_c = serve_bench.level_seeds(args.seed, c)
            for side in order:
                one(side, c, warm_seed, warm=True)
            pairs = []
            for k in range(args.interleave):
                seed = seed_c + 100_003 * (k + 1)  # fresh prompts, the same for each side
                pair = {}
                for side in order if k % 2 == 0 else order[::-1]:
                    pair[side] = one(side, c, seed)
                pairs.append(pair)
                print(
                    f"  C={c} pair {k + 1}: "
                    + ", ".join(f"{s} {r['output_tps']:.1f} tok/s" for s, r in pair.items()),
                    flush=True,
                )
            out.append({"concurrency": c, "pairs": pairs})
    return out


def summarise_interleaved(levels: list[dict]) -> list[dict]:
    """Per level and server side: medians over the pairs of the side/engine ratios."""
    med = statistics.median
    rows = []
    for lv in levels:
        sides = [s for s in lv["pairs"][0] if s != "engine"]
        row: dict = {"concurrency": lv["concurrency"]}
        for side in sides:
            ps = [p for p in lv["pairs"] if side in p]
            tps = [p[side]["output_tps"] for p in ps]
            row[side] = {
                "tps": tps,
                "tps_median": med(tps),
                "errors": sum(p[side]["errors"] for p in ps),
            }
            if all("engine" in p for p in ps):
                ratio = [p[side]["output_tps"] / p["engine"]["output_tps"] for p in ps]
                ttft = [
                    (p[side]["ttft_p50"] - p["engine"]["ttft_p50"]) * 1000
                    for p in ps
                    if p[side]["ttft_p50"] is not None and p["engine"]["ttft_p50"]
                ]
                itl = [
                    p[side]["itl_p95"] / p["engine"]["itl_p95"]
                    for p in ps
                    if p[side].get("itl_p95") and p["engine"].get("itl_p95")
                ]
                row[side].update(
                    ratio=ratio,
                    ratio_median=med(ratio),
                    ttft_p50_diff_ms_median=med(ttft) if ttft else None,
                    itl_p95_ratio_median=med(itl) if itl else None,
                )
        if all("engine" in p for p in lv["pairs"]):
            row["engine_tps"] = [p["engine"]["output_tps"] for p in lv["pairs"]]
        rows.append(row)
    return rows


def print_interleaved(rows: list[dict]) -> None:
    print(
        "\n| C | side | ratio to the engine per pair | median | tok/s median (engine) | "
        "TTFT p50 - engine, ms (median) | ITL p95 / engine (median) | errors |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        eng = row.get("engine_tps")
        for side, r in row.items():
            if not isinstance(r, dict):
                continue
            f = lambda x, fmt: fmt.format(x) if x is not None else "-"  # noqa: E731
            print(
                f"| {row['concurrency']} | {side} | "
                f"{', '.join(f'{x:.2f}' for x in r.get('ratio', [])) or '-'} | "
                f"{f(r.get('ratio_median'), '{:.2f}')} | {r['tps_median']:.0f} "
                f"({f(statistics.median(eng) if eng else None, '{:.0f}')}) | "
                f"{f(r.get('ttft_p50_diff_ms_median'), '{:+.0f}')} | "
                f"{f(r.get('itl_p95_ratio_median'), '{:.2f}')} | {r['errors']} |"
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-words", type=int, default=8)
    ap.add_argument("--max-words", type=int, default=64)
    ap.add_argument(
        "--mlx-lm-blas",
        action="store_true",
        help="also run mlx_lm.server with the optimised BLAS preloaded",
    )
    ap.add_argument("--skip", default="", help="comma list of engine,mlxd,mlx_lm")
    ap.add_argument("--logdir", default="/tmp")
    ap.add_argument(
        "--short-warmup",
        action="store_true",
        help="warm up with one 8-token request per client (CPU: nothing compiles)",
    )
    ap.add_argument(
        "--client-procs", type=int, default=1, help="spread the clients over this many processes"
    )
    ap.add_argument(
        "--api-workers",
        type=int,
        default=1,
        help="mlxd front-end processes (mlxd serve --api-workers)",
    )
    ap.add_argument("--mlxd-args", default="", help="extra mlxd serve arguments")
    ap.add_argument(
        "--engine-env",
        default="",
        help="KEY=VAL,... for the engine-alone process only (e.g. "
        "MLX_CUDA_USE_CUDNN_SDPA=0, the setting mlxd's engine core uses)",
    )
    ap.add_argument(
        "--metrics",
        action="store_true",
        help="per level, the server's mean queue time, TTFT and latency from /metrics (mlxd only)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alternate the engine alone and mlxd this many times, fresh prompts "
        "each round (the module's docstring says why)",
    )
    ap.add_argument(
        "--interleave",
        type=int,
        default=0,
        metavar="K",
        help="engine and mlxd all loaded at once, K pairs of passes per level "
        "in alternating order (run_interleaved)",
    )
    ap.add_argument(
        "--also-api-workers",
        type=int,
        default=0,
        metavar="N",
        help="with --interleave: a second mlxd server with --api-workers N as a third side",
    )
    ap.add_argument(
        "--also-env",
        action="append",
        default=[],
        metavar="NAME:VAR=VALUE,...",
        help="with --interleave: one more mlxd server side called NAME, with "
        "these environment variables (repeatable)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.levels = [int(x) for x in args.concurrency.split(",")]
    skip = set(args.skip.split(","))
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    results: dict = {
        "model_dir": args.model_dir,
        "max_tokens": args.max_tokens,
        "engine_env": args.engine_env,
        "mlxd_env": {k: v for k, v in os.environ.items() if k.startswith("MLXD_")},
        "api_workers": args.api_workers,
        "command": " ".join(sys.argv),
        "requests_per_client": args.requests_per_client,
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    name = Path(args.model_dir).name
    mlxd_cmd = [
        sys.executable,
        "-m",
        "mlxd",
        "serve",
        "--model",
        args.model_dir,
        "--max-num-seqs",
        str(max(args.levels)),
        "--log-level",
        "warning",
        "--api-workers",
        str(args.api_workers),
        *args.mlxd_args.split(),
    ]
    # The prefix cache's disk tier outlives the server, and the prompts are the same from
    # run to run (seeded): in the default home a later run found an earlier run's prompts
    # on disk and skipped their prefill (on an H200, a third of the prefill steps of every
    # run after the first). Each run gets a disk tier of its own unless the caller names one.
    prefix_dir = tempfile.TemporaryDirectory(prefix="mlxd-prefix-")
    mlxd_env = {"MLXD_ENGINE__PREFIX_CACHE_DIR": prefix_dir.name, **env}
    if args.interleave:
        sides = {} if "mlxd" in skip else {"mlxd": (mlxd_cmd, mlxd_env)}
        dirs = []
        if args.also_api_workers:
            dirs.append(tempfile.TemporaryDirectory(prefix="mlxd-prefix-"))
            i = mlxd_cmd.index("--api-workers")
            cmd_b = [*mlxd_cmd[: i + 1], str(args.also_api_workers), *mlxd_cmd[i + 2 :]]
            sides[f"mlxd-aw{args.also_api_workers}"] = (
                cmd_b,
                dict(mlxd_env, MLXD_ENGINE__PREFIX_CACHE_DIR=dirs[-1].name),
            )
        for spec in args.also_env:
            side, _, pairs = spec.partition(":")
            extra = dict(kv.split("=", 1) for kv in pairs.split(",") if kv)
            dirs.append(tempfile.TemporaryDirectory(prefix="mlxd-prefix-"))
            sides[side] = (
                mlxd_cmd,
                dict(mlxd_env, MLXD_ENGINE__PREFIX_CACHE_DIR=dirs[-1].name, **extra),
            )
        results["also_env"] = args.also_env
        results["interleaved"] = run_interleaved(args, skip, sides, name)
        results["interleaved_summary"] = summarise_interleaved(results["interleaved"])
        print_interleaved(results["interleaved_summary"])
        for d in dirs:
            d.cleanup()
        prefix_dir.cleanup()
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))
        return
    if args.rounds > 1:
        results["rounds"] = run_rounds(args, skip, mlxd_cmd, mlxd_env, name)
        first = results["rounds"][0]
        results.update({k: first[k] for k in ("engine", "mlxd") if k in first})
    else:
        if "engine" not in skip:
            print("engine alone", flush=True)
            results["engine"] = bench_engine(args)
        if "mlxd" not in skip:
            print("mlxd", flush=True)
            results["mlxd"] = bench_server(mlxd_cmd, mlxd_env, name, args, "/health")
    prefix_dir.cleanup()
    if "mlx_lm" not in skip:
        print("mlx_lm.server (as shipped)", flush=True)
        results["mlx_lm"] = bench_server(
            [
                sys.executable,
                "-m",
                "mlx_lm.server",
                "--model",
                args.model_dir,
                "--decode-concurrency",
                str(max(args.levels)),
            ],
            env,
            args.model_dir,
            args,
            "/v1/models",
        )
        if args.mlx_lm_blas:
            from mlxd import blas

            info = blas.preload("auto")
            if info.loaded:
                print(f"mlx_lm.server with {info.name} preloaded", flush=True)
                results["mlx_lm_blas"] = bench_server(
                    [
                        sys.executable,
                        "-m",
                        "mlx_lm.server",
                        "--model",
                        args.model_dir,
                        "--decode-concurrency",
                        str(max(args.levels)),
                    ],
                    dict(env, LD_PRELOAD=info.path),
                    args.model_dir,
                    args,
                    "/v1/models",
                )
    if "rounds" in results:
        print(f"\nthe first of {args.rounds} rounds:", end="")
    print(
        "\n| C | engine tok/s | mlxd tok/s | mlx_lm.server tok/s | mlxd/engine | "
        "mlxd/mlx_lm | TTFT p50 engine / mlxd / mlx_lm | decode tok/s per request "
        "engine / mlxd / mlx_lm |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for i, c in enumerate(args.levels):
        e = (results.get("engine") or [{}] * 99)[i]
        m = (results.get("mlxd") or [{}] * 99)[i]
        s = (results.get("mlx_lm") or [{}] * 99)[i]

        def f(x, fmt="{:.1f}"):
            return fmt.format(x) if isinstance(x, (int, float)) else "-"

        print(
            f"| {c} | {f(e.get('output_tps'))} | {f(m.get('output_tps'))} | "
            f"{f(s.get('output_tps'))} | "
            f"{f(m.get('output_tps', 0) / e['output_tps'] if e.get('output_tps') else None, '{:.2f}')} | "
            f"{f(m.get('output_tps', 0) / s['output_tps'] if s.get('output_tps') else None, '{:.2f}')} | "
            f"{f(e.get('ttft_p50'), '{:.3f}')} / {f(m.get('ttft_p50'), '{:.3f}')} / "
            f"{f(s.get('ttft_p50'), '{:.3f}')} | "
            f"{f(e.get('decode_tps_per_request'))} / {f(m.get('decode_tps_per_request'))} / "
            f"{f(s.get('decode_tps_per_request'))} |"
        )
    if "rounds" in results:
        print_rounds(args, results["rounds"])
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


def run_rounds(args, skip: set, mlxd_cmd: list[str], mlxd_env: dict, name: str) -> list[dict]:
    """Engine alone and mlxd in turns, round after round, on fresh prompts each round
    (mlxd's server stays up: a round's prompts must not be the previous round's, or its
    prefix cache would answer them)."""
    rounds: list[dict] = []
    with contextlib.ExitStack() as stack:
        url = (
            stack.enter_context(serving(mlxd_cmd, mlxd_env, args, "/health"))
            if "mlxd" not in skip
            else None
        )
        for i in range(args.rounds):
            seed = args.seed + 1000 * i
            rnd: dict = {"round": i + 1, "seed": seed}
            if "engine" not in skip:
                print(f"round {i + 1}: engine alone", flush=True)
                rnd["engine"] = bench_engine(args, seed)
                for r in rnd["engine"]:
                    print(
                        f"  C={r['concurrency']}: {r['output_tps']:.1f} tok/s (engine), "
                        f"ttft p50 {r['ttft_p50']:.3f}s",
                        flush=True,
                    )
            if url is not None:
                print(f"round {i + 1}: mlxd", flush=True)
                rnd["mlxd"] = measure_server(url, name, args, seed)
            rounds.append(rnd)
    return rounds


def print_rounds(args, rounds: list[dict]) -> None:
    """Per level: each round's mlxd / engine ratio and their median."""
    print(
        "\n| C | mlxd / engine per round | median | engine tok/s per round | mlxd tok/s per round |"
    )
    print("|---|---|---|---|---|")
    for i, c in enumerate(args.levels):
        eng = [r["engine"][i]["output_tps"] for r in rounds if r.get("engine")]
        mx_ = [r["mlxd"][i]["output_tps"] for r in rounds if r.get("mlxd")]
        ratios = [m / e for m, e in zip(mx_, eng, strict=False) if e]
        med = statistics.median(ratios) if ratios else None
        print(
            f"| {c} | {', '.join(f'{x:.2f}' for x in ratios) or '-'} | "
            f"{f'{med:.2f}' if med is not None else '-'} | "
            f"{', '.join(f'{x:.0f}' for x in eng) or '-'} | "
            f"{', '.join(f'{x:.0f}' for x in mx_) or '-'} |"
        )


if __name__ == "__main__":
    main()
