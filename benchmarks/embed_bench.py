"""Embeddings throughput: dynamic batching vs batching off vs the engine alone.

    python benchmarks/embed_bench.py [--seconds 15] [--clients 64] [--model all-minilm-l6-v2]
        [--max-batch-size 32] [--max-wait-ms 5] [--repeat 3] [--home DIR] [--out FILE]

- server (batching): ``python -m mlxd serve`` with the default ``batch:`` settings
  (``--max-batch-size``/``--max-wait-ms`` to change them); ``--clients`` concurrent clients
  each POST one sentence at a time to /v1/embeddings for ``--seconds``.
- server (batching off): the same with ``MLXD_BATCH_MAX_BATCH_SIZE=1``.
- engine alone: the same EmbeddingEngine in this process (after the same BLAS preload the
  server does), embedding the same sentences offline in batches of ``--max-batch-size``
  (tokenization included), for ``--seconds``.

The clients speak raw HTTP/1.1 over asyncio streams (keep-alive), so the load generator
costs the shared CPU as little as possible. Reported: sentences/s, p50/p95 latency, the
ratios the issue asks for, and which BLAS MLX used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORDS = (
    "the a of to and in is it you that he was for on are with as his they be at one have "
    "this from or had by hot word but what some we can out other were all there when up use "
    "your how said an each she which do their time if will way about many then them write "
    "would like so these her long make thing see him two has look more day could go come "
    "did number sound no most people my over know water than call first who may down side "
    "been now find any new work part take get place made live where after back little only "
    "round man year came show every good me give our under name very through just form "
    "sentence great think say help low line differ turn cause much mean before move right "
    "boy old too same tell does set three want air well also play small end put home read "
    "hand port large spell add even land here must big high such follow act why ask men "
    "change went light kind off need house picture try us again animal point mother world "
    "near build self earth father head stand own page should country found answer school "
    "grow study still learn plant cover food sun four between state keep eye never last let "
    "thought city tree cross farm hard start might story saw far sea draw left late run"
).split()


def make_sentences(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct English-like sentences of 6 to 18 words (about 8-22 MiniLM tokens)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 18))]
        out.append(" ".join(words).capitalize() + f" (#{i}).")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- a minimal keep-alive HTTP/1.1 client ------------------------------------------------------


class Conn:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.r: asyncio.StreamReader | None = None
        self.w: asyncio.StreamWriter | None = None

    async def post_json(self, path: str, body: dict) -> tuple[int, bytes]:
        if self.w is None:
            self.r, self.w = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode()
        self.w.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        assert self.r is not None
        head = await self.r.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length = 0
        for line in lines[1:]:
            k, _, v = line.partition(":")
            if k.strip().lower() == "content-length":
                length = int(v)
        payload = await self.r.readexactly(length)
        return status, payload


async def run_clients(
    port: int, model: str, sentences: list[str], clients: int, seconds: float, warmup: float
) -> dict:
    lat: list[float] = []
    done = 0
    errors = 0
    t_start = time.perf_counter()
    t_measure = t_start + warmup
    t_end = t_measure + seconds

    async def client(k: int) -> None:
        nonlocal done, errors
        conn = Conn("127.0.0.1", port)
        i = k
        while True:
            t0 = time.perf_counter()
            if t0 >= t_end:
                return
            status, payload = await conn.post_json(
                "/v1/embeddings", {"model": model, "input": sentences[i % len(sentences)]}
            )
            t1 = time.perf_counter()
            if status != 200:
                errors += 1
            elif t0 >= t_measure:
                lat.append(t1 - t0)
                done += 1
            i += clients

    await asyncio.gather(*(client(k) for k in range(clients)))
    lat.sort()

    def pct(p: float) -> float:
        return lat[min(int(p * len(lat)), len(lat) - 1)] * 1000 if lat else float("nan")

    return {
        "sentences_per_s": done / seconds,
        "requests": done,
        "errors": errors,
        "p50_ms": pct(0.50),
        "p95_ms": pct(0.95),
        "p99_ms": pct(0.99),
    }


def wait_ready(port: int, proc: subprocess.Popen, model: str, timeout: float = 600) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            r = httpx.post(
                f"http://127.0.0.1:{port}/v1/embeddings",
                json={"model": model, "input": "warm up"},
                timeout=60,
            )
            if r.status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError("server did not become ready")


def bench_server(args, env_extra: dict, label: str, sentences: list[str]) -> dict:
    port = free_port()
    env = dict(os.environ, MLXD_HOME=args.home, HF_HUB_OFFLINE="1", **env_extra)
    log_path = Path(args.home) / f"server-{label}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlxd",
                "serve",
                "--port",
                str(port),
                "--preload",
                args.model,
                "--log-level",
                "warning",
            ],
            env=env,
            stdout=log,
            stderr=log,
            cwd=ROOT,
        )
        try:
            wait_ready(port, proc, args.model)
            res = asyncio.run(
                run_clients(port, args.model, sentences, args.clients, args.seconds, args.warmup)
            )
            import httpx

            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
            m = next((x for x in health.get("models", []) if x["name"] == args.model), {})
            res["max_batch_size_seen"] = m.get("max_batch_size_seen")
            return res
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def bench_engine(args, sentences: list[str]) -> dict:
    """The engine alone, offline: tokenize + embed in batches, no HTTP, no queue."""
    from mlxd import blas

    info = blas.preload(os.environ.get("MLXD_BLAS", "auto"))  # as the server reads it
    from mlxd.config import load_settings
    from mlxd.engines.embed import EmbeddingEngine
    from mlxd.engines.encoder import batch_policy
    from mlxd.store.local import ModelStore
    from mlxd.store.pull import ensure_model

    os.environ["MLXD_HOME"] = args.home
    settings = load_settings()
    path = ensure_model(ModelStore(settings.models_dir), args.model, settings.models)
    eng = EmbeddingEngine(args.model, path, batch_policy(settings))
    eng.warmup()
    bs = args.max_batch_size
    i = done = 0
    t_end = None
    t0 = time.perf_counter()
    while True:
        now = time.perf_counter()
        if t_end is None and now - t0 >= args.warmup:
            t_end, t_measure, done = now + args.seconds, now, 0
        if t_end is not None and now >= t_end:
            break
        batch = [sentences[(i + k) % len(sentences)] for k in range(bs)]
        ids = [x for x, _ in eng.encode_inputs(batch, truncate=True)]
        eng.embed_batch(ids)
        i += bs
        done += bs
    return {
        "sentences_per_s": done / (time.perf_counter() - t_measure),
        "batch_size": bs,
        "blas": info.describe(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--model", default="all-minilm-l6-v2")
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--max-wait-ms", type=float, default=5.0)
    ap.add_argument("--home", default="/tmp/mlxd-embed-bench")
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", choices=["engine", "batching", "off"], action="append")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of all phases (order rotated); medians are reported",
    )
    args = ap.parse_args()
    Path(args.home).mkdir(parents=True, exist_ok=True)
    sentences = make_sentences(4096)
    only = [
        x
        for x in ("engine", "batching", "off")
        if x in set(args.only or ["engine", "batching", "off"])
    ]
    results: dict = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores "
        f"{platform.processor() or ''}".strip(),
        "python": platform.python_version(),
        "args": vars(args),
        "runs": [],
    }
    batching = {
        "MLXD_BATCH_MAX_BATCH_SIZE": str(args.max_batch_size),
        "MLXD_BATCH_MAX_WAIT_MS": str(args.max_wait_ms),
    }
    labels = {
        "batching": "server, dynamic batching",
        "off": "server, batching off",
        "engine": "engine alone, offline",
    }
    for r in range(args.repeat):
        # Rotate the order each round: a shared machine's background load drifts.
        order = only[r % len(only) :] + only[: r % len(only)]
        run: dict = {}
        for phase in order:
            if phase == "batching":
                run[phase] = bench_server(args, batching, "batching", sentences)
            elif phase == "off":
                run[phase] = bench_server(
                    args, {"MLXD_BATCH_MAX_BATCH_SIZE": "1"}, "off", sentences
                )
            else:
                run[phase] = bench_engine(args, sentences)
            print(f"round {r + 1} {labels[phase]}: {run[phase]}", flush=True)
        results["runs"].append(run)

    def median(phase: str, key: str) -> float:
        vals = sorted(run[phase][key] for run in results["runs"])
        return (
            vals[len(vals) // 2]
            if len(vals) % 2
            else sum(vals[len(vals) // 2 - 1 : len(vals) // 2 + 1]) / 2
        )

    results["median"] = {
        p: {
            k: median(p, k)
            for k in ("sentences_per_s", "p50_ms", "p95_ms")
            if k in results["runs"][0][p]
        }
        for p in only
    }
    for p in only:
        print(f"median {labels[p]}: {results['median'][p]}")
    if len(only) == 3:
        m = results["median"]
        sb = m["batching"]["sentences_per_s"]
        results["ratio_vs_engine"] = sb / m["engine"]["sentences_per_s"]
        results["ratio_vs_batching_off"] = sb / m["off"]["sentences_per_s"]
        print(
            f"batching / engine = {results['ratio_vs_engine']:.2f} (goal >= 0.8); "
            f"batching / off = {results['ratio_vs_batching_off']:.2f} (goal >= 4)"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
