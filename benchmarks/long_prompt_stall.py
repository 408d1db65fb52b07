"""What a long prompt arriving beside running streams costs them: mlxd with its step budget
(engine.max_step_tokens) on and off, mlx_lm.server when it runs here, and vllm-mlx with
its chunked prefill on and off where ``--vllm-mlx-python`` names a venv that has it.

Per trial: 8 streaming chat clients decode; once each has its first tokens, one long prompt
arrives (``--prompt-tokens``: 2k by default, 16384 for a GPU). Reported per side:
the streams' max and p99 inter-token gap while the long prompt prefills (from its
submission to its first token), their median gap before it arrived, and the long prompt's
TTFT beside the streams against its TTFT alone (same length, other words, just before).
Sides take turns in ABBA order, ``--pairs`` times (10 or more for a real measurement),
all servers loaded throughout; every prompt is new (random words), so no prefix cache
answers one.

    python benchmarks/long_prompt_stall.py --pairs 10 --out stall.json
    python benchmarks/long_prompt_stall.py --model-dir /tmp/q05 --prompt-tokens 16384 \\
        --pairs 10 --out stall.json
    bash benchmarks/peers/vllm_mlx_env.sh /tmp/vmlx
    PYTHONPATH=src python benchmarks/long_prompt_stall.py --vllm-mlx-python /tmp/vmlx/bin/python \\
        --peer-blas --pairs 10 --out stall.json

``--peer-blas`` preloads the BLAS mlxd loads (``LD_PRELOAD``) into mlx_lm.server and
vllm-mlx: on a Linux CPU MLX's own is ~20x slower at float32 matmuls.

Without ``--model-dir`` it writes ``make_random_model.py --shape qwen2.5-vocab-tiny``
(float32) to a temporary folder: a 2k-token prefill there takes measurable time on a CPU
(its 151,936-token head runs over every prompt position) while a decode step stays cheap.
Its byte-level tokenizer makes one token of each byte, so a prompt's length is exact.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlxd_proc  # noqa: E402

WORDS = (
    "river mountain city history science music market garden ocean language computer "
    "winter summer library engine question answer story morning evening"
).split()


def words(n_chars: int, rng: random.Random) -> str:
    """Random words, ``n_chars`` characters long (that many tokens, byte-level)."""
    out: list[str] = []
    size = 0
    while size < n_chars:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_chars]


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def stream(
    client: httpx.AsyncClient,
    model: str,
    text: str,
    max_tokens: int,
    stamps: list[float],
    stop: asyncio.Event | None = None,
) -> None:
    """A streaming chat; one monotonic stamp per content chunk, until done or ``stop``."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if stop is not None and stop.is_set():
                return
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            # a reply that is only an end of text still marks its first token
            if choices[0].get("delta", {}).get("content") or (
                not stamps and choices[0].get("finish_reason")
            ):
                stamps.append(time.monotonic())


async def ttft(client: httpx.AsyncClient, model: str, text: str) -> float:
    stamps: list[float] = []
    t0 = time.monotonic()
    await stream(client, model, text, 4, stamps)
    return stamps[0] - t0


async def keep_streaming(
    client: httpx.AsyncClient,
    model: str,
    text: str,
    max_tokens: int,
    runs: list[list[float]],
    stop: asyncio.Event,
) -> None:
    """One stream, restarted whenever its reply ends (a real model stops on its own), a
    list of stamps per request: a gap is between two tokens of one reply."""
    while not stop.is_set():
        runs.append([])
        await stream(client, model, text, max_tokens, runs[-1], stop)


async def trial(url: str, model: str, args: argparse.Namespace, rng: random.Random) -> dict:
    """One long prompt alone, then one beside ``args.streams`` decoding streams."""
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0)) as client:
        alone = await ttft(client, model, words(args.prompt_tokens, rng))
        stop = asyncio.Event()
        runs: list[list[list[float]]] = [[] for _ in range(args.streams)]
        tasks = [
            asyncio.create_task(
                keep_streaming(
                    client,
                    model,
                    f"story {i}: " + words(40, rng),
                    args.stream_tokens,
                    runs[i],
                    stop,
                )
            )
            for i in range(args.streams)
        ]
        deadline = time.monotonic() + 600
        while any(sum(map(len, r)) < args.warm_tokens for r in runs):
            if time.monotonic() > deadline or any(t.done() for t in tasks):
                raise RuntimeError("the streams did not start")
            await asyncio.sleep(0.005)
        submitted = time.monotonic()
        beside = await ttft(client, model, words(args.prompt_tokens, rng))
        first = submitted + beside
        await asyncio.sleep(0.2)  # the gap that spans the first token closes
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    before, during = [], []
    for s in (s for r in runs for s in r):
        for a, b in zip(s, s[1:], strict=False):
            if b <= submitted:
                before.append(b - a)
            elif a < first:  # a gap that overlaps the prefill
                during.append(b - a)
    await asyncio.sleep(0.5)  # the cancelled streams leave the batch
    return {
        "ttft_alone_s": alone,
        "ttft_beside_s": beside,
        "gap_before_median_s": statistics.median(before) if before else None,
        "gap_during_max_s": max(during) if during else None,
        "gap_during_p99_s": pct(during, 99),
        "gaps_during": len(during),
    }


def summarise(trials: list[dict]) -> dict:
    """Medians over the trials of each figure."""
    keys = [k for k in trials[0] if k != "gaps_during"]
    out = {
        k: statistics.median([t[k] for t in trials if t[k] is not None] or [float("nan")])
        for k in keys
    }
    out["trials"] = len(trials)
    return out


def loaded_model(url: str) -> dict:
    """mlxd's one loaded model, as /health lists it."""
    return httpx.get(url + "/health", timeout=30).json()["models"][0]


def peer_env(same_blas: bool) -> dict[str, str]:
    """The peers' environment: inherited, plus the BLAS mlxd loads preloaded with ``same_blas``."""
    env = dict(os.environ)
    if not same_blas:
        return env
    from mlxd import blas
    from mlxd.config import load_settings

    info = blas.preload(load_settings(None).backend.blas)
    if not info.loaded or info.path is None:
        sys.exit(f"--peer-blas: mlxd loads no BLAS of its own here ({info.name})")
    before = env.get("LD_PRELOAD")
    env["LD_PRELOAD"] = f"{info.path} {before}" if before else info.path
    return env


def start_vllm_mlx(
    python: str,
    model_dir: str,
    name: str,
    args: argparse.Namespace,
    chunk: int,
    tmp: Path,
    env: dict[str, str],
) -> tuple[subprocess.Popen, str]:
    """``vllm-mlx serve`` with continuous batching and ``chunk`` prefill tokens per step
    (0: off); HOME is a temporary folder, so its prefix-cache files stay out of the real one."""
    port = mlxd_proc.free_port()
    home = tmp / f"vllm-mlx-{chunk}"
    home.mkdir()
    cmd = [
        python,
        "-m",
        "vllm_mlx.cli",
        "serve",
        model_dir,
        "--port",
        str(port),
        "--served-model-name",
        name,
        "--continuous-batching",
        "--max-num-seqs",
        str(max(16, args.streams + 1)),
        "--disable-prefix-cache",
        "--chunked-prefill-tokens",
        str(chunk),
        *shlex.split(args.vllm_mlx_args),
    ]
    log = (home / "server.log").open("wb")  # it logs every request: a pipe would fill
    env = {**env, "HOME": str(home), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                print(f"vllm-mlx ready: {shlex.join(cmd)}", flush=True)
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(
        f"vllm-mlx did not start ({shlex.join(cmd)}):\n"
        + (home / "server.log").read_text(errors="replace")[-2000:]
    )


def start_mlx_lm(
    model_dir: str, streams: int, env: dict[str, str]
) -> tuple[subprocess.Popen, str] | None:
    port = mlxd_proc.free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlx_lm.server",
            "--model",
            model_dir,
            "--port",
            str(port),
            "--decode-concurrency",
            str(streams + 1),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    print(
        "mlx_lm.server did not start:",
        (proc.stderr.read().decode()[-500:] if proc.poll() is not None else "timeout"),
    )
    proc.kill()
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", help="a model directory (default: a tiny random one)")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument(
        "--stream-tokens",
        type=int,
        default=8192,
        help="max_tokens of each stream (they are stopped after each trial)",
    )
    ap.add_argument(
        "--warm-tokens",
        type=int,
        default=8,
        help="tokens each stream has before the long prompt arrives",
    )
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--budget", default="auto", help="engine.max_step_tokens of the 'on' side")
    ap.add_argument(
        "--speculative",
        default="off",
        help="engine.speculative of every mlxd side; off by default, so that the streams' "
        "gaps are decode steps' and not bursts of accepted drafts",
    )
    ap.add_argument(
        "--mlxd-sides",
        default="budget_on,unmixed,budget_off",
        help="mlxd sides, comma-separated: budget_on (--budget, mixed steps: the defaults), "
        "unmixed (--budget, engine.mixed_steps false), budget_off (no budget)",
    )
    ap.add_argument("--skip-mlx-lm", action="store_true")
    ap.add_argument(
        "--vllm-mlx-python",
        help="python of a venv with vllm-mlx (benchmarks/peers/vllm_mlx_env.sh): adds its sides",
    )
    ap.add_argument(
        "--vllm-mlx-chunk",
        default="256,0",
        help="vllm-mlx --chunked-prefill-tokens, one side per value, comma-separated (0: off)",
    )
    ap.add_argument("--vllm-mlx-args", default="", help="more `vllm-mlx serve` arguments")
    ap.add_argument(
        "--peer-blas",
        action="store_true",
        help="preload the BLAS mlxd loads into mlx_lm.server and vllm-mlx (Linux CPU)",
    )
    ap.add_argument("--out")
    args = ap.parse_args()
    penv = peer_env(args.peer_blas)  # before MLX is imported here: mlxd.blas loads it first

    tmp = tempfile.TemporaryDirectory(prefix="stall-")
    model_dir = args.model_dir
    if model_dir is None:
        from make_random_model import write_random_model

        model_dir = str(Path(tmp.name) / "stall-model")
        write_random_model("qwen2.5-vocab-tiny", "float32", Path(model_dir))
    procs: dict[str, subprocess.Popen] = {}
    urls: dict[str, str] = {}
    common = {
        "MLXD_ENGINE__PREFIX_CACHE_BYTES": "0",
        "MLXD_ENGINE__MAX_NUM_SEQS": str(max(16, args.streams + 1)),
        "MLXD_ENGINE__SPECULATIVE": args.speculative,
    }
    try:
        settings = {
            "budget_on": {"MLXD_ENGINE__MAX_STEP_TOKENS": args.budget},
            "unmixed": {
                "MLXD_ENGINE__MAX_STEP_TOKENS": args.budget,
                "MLXD_ENGINE__MIXED_STEPS": "false",
            },
            "budget_off": {"MLXD_ENGINE__MAX_STEP_TOKENS": "0"},
        }
        for side in (s.strip() for s in args.mlxd_sides.split(",") if s.strip()):
            home = Path(tmp.name) / side
            procs[side], urls[side] = mlxd_proc.start(
                str(home), model_dir, {**common, **settings[side]}
            )
        mlxd_sides = list(urls)
        models = {side: loaded_model(urls[side])["name"] for side in mlxd_sides}
        if not args.skip_mlx_lm:
            started = start_mlx_lm(model_dir, args.streams, penv)
            if started is not None:
                procs["mlx_lm"], urls["mlx_lm"] = started
                models["mlx_lm"] = model_dir  # mlx_lm.server names its model by its path
        if args.vllm_mlx_python:
            for chunk in (int(c) for c in args.vllm_mlx_chunk.split(",") if c.strip()):
                side = f"vllm_mlx_chunk{chunk}"
                models[side] = Path(model_dir).name
                procs[side], urls[side] = start_vllm_mlx(
                    args.vllm_mlx_python, model_dir, models[side], args, chunk, Path(tmp.name), penv
                )
        budgets = {side: loaded_model(urls[side])["step_budget"] for side in mlxd_sides}
        sides = list(urls)
        rng = random.Random(0)
        trials: dict[str, list[dict]] = {s: [] for s in sides}
        for i in range(args.pairs):
            order = sides if i % 2 == 0 else sides[::-1]  # ABBA
            for side in order:
                t = asyncio.run(trial(urls[side], models[side], args, rng))
                trials[side].append(t)
                print(
                    f"pair {i + 1} {side}: "
                    + ", ".join(f"{k} {v:.3f}" for k, v in t.items() if isinstance(v, float)),
                    flush=True,
                )
        summary = {side: summarise(ts) for side, ts in trials.items()}
    finally:
        for proc in procs.values():
            mlxd_proc.stop(proc)
        tmp.cleanup()
    print(
        "\n| side | gap before (median) | gap during max | gap during p99 | "
        "TTFT beside | TTFT alone |\n|---|---|---|---|---|---|"
    )
    for side, s in summary.items():
        print(
            f"| {side} | {s['gap_before_median_s'] * 1e3:.1f} ms | "
            f"{s['gap_during_max_s'] * 1e3:.1f} ms | {s['gap_during_p99_s'] * 1e3:.1f} ms | "
            f"{s['ttft_beside_s']:.3f} s | {s['ttft_alone_s']:.3f} s |"
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "command": sys.argv,
                    "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                    "model_dir": args.model_dir or "qwen2.5-vocab-tiny (random, float32)",
                    "prompt_tokens": args.prompt_tokens,
                    "streams": args.streams,
                    "speculative": args.speculative,
                    "step_budgets": budgets,  # each mlxd side's /health at the start
                    "commit": mlxd_proc.commit(),
                    "vllm_mlx_python": args.vllm_mlx_python,
                    "peer_ld_preload": penv.get("LD_PRELOAD") if args.peer_blas else None,
                    "summary": summary,
                    "trials": trials,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
