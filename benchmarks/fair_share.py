"""Fair share between API keys: how long one request of key B waits behind key A's flood.

    python benchmarks/fair_share.py [--model PATH] [--flood 64] [--repeats 10]
                                    [--max-num-seqs 8] [--out result.json]

Starts `mlxd serve` (a throwaway MLXD_HOME; without --model a tiny random llama from
tests/fixtures) with two API keys, then, interleaved, ``--repeats`` times each:

* idle: B sends one streaming request to an idle server;
* flood: A sends ``--flood`` long streaming requests, and once they queue behind the
  ``--max-num-seqs`` slots, B sends the same request;
* same key: as flood, but the single request comes from A itself, so it queues behind its
  own flood in arrival order (what every caller met before fair queuing).

Each arm's time to first token (request sent -> first streamed token) is reported as
median, quartiles and range, with per-repeat ratios (flood over idle, same key over other
key), the load average before and after, and the preemptions the server counted. After
each loaded measurement the flood's streams hang up and the server is idle again before
the next arm. The random model's end tokens are
banned, so every request runs its max_tokens out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(Path(__file__).parent)]
from mlxd_proc import start, stop  # noqa: E402

KEYS = {"a": "sk-fair-a-0123456789", "b": "sk-fair-b-0123456789"}


def eos_ban(model: Path) -> dict[str, float]:
    """logit_bias against the model's end tokens (tokenizer.json's added tokens)."""
    added = json.loads((model / "tokenizer.json").read_text()).get("added_tokens", [])
    names = ("<|im_end|>", "<|endoftext|>", "</s>", "<|end_of_text|>")
    return {str(t["id"]): -100.0 for t in added if t["content"] in names}


def ttft(url: str, key: str, body: dict) -> float:
    """Seconds from sending a streaming completion to its first token."""
    t0 = time.perf_counter()
    with httpx.stream(
        "POST",
        url + "/v1/completions",
        json={**body, "stream": True},
        headers={"Authorization": f"Bearer {key}"},
        timeout=900,
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - t0
    raise RuntimeError("stream ended without a token")


def waiting(url: str, model: str) -> int:
    health = httpx.get(
        url + "/health", headers={"Authorization": f"Bearer {KEYS['a']}"}, timeout=30
    ).json()
    m = next(m for m in health["models"] if m["name"] == model)
    return sum(m["queue"]["by_priority"].values())


def idle(url: str, model: str) -> None:
    while True:
        health = httpx.get(
            url + "/health", headers={"Authorization": f"Bearer {KEYS['a']}"}, timeout=30
        ).json()
        m = next(m for m in health["models"] if m["name"] == model)
        if m["running"] == 0 and m["waiting"] == 0:
            return
        time.sleep(0.1)


def flood(
    url: str, model: str, n: int, body: dict, hold: threading.Event
) -> list[threading.Thread]:
    """``n`` streams of key A that hang up once ``hold`` is set."""

    def one(i: int) -> None:
        try:
            with httpx.stream(
                "POST",
                url + "/v1/completions",
                json={**body, "prompt": f"flood request {i}", "stream": True},
                headers={"Authorization": f"Bearer {KEYS['a']}"},
                timeout=900,
            ) as r:
                for _ in r.iter_lines():
                    if hold.is_set():
                        return
        except httpx.HTTPError:
            pass

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def loaded(url: str, model: str, args: argparse.Namespace, key: str, body: dict) -> float:
    hold = threading.Event()
    threads = flood(url, model, args.flood, {**body, "max_tokens": args.flood_tokens}, hold)
    want = args.flood - args.max_num_seqs
    deadline = time.time() + 600
    while waiting(url, model) < want and time.time() < deadline:
        time.sleep(0.05)
    try:
        return ttft(url, key, body)
    finally:
        hold.set()
        for t in threads:
            t.join(900)
        idle(url, model)


def summary(xs: list[float]) -> dict[str, Any]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {
        "median_s": round(statistics.median(xs), 4),
        "p25_s": round(q[0], 4),
        "p75_s": round(q[2], 4),
        "min_s": round(min(xs), 4),
        "max_s": round(max(xs), 4),
        "runs_s": [round(x, 4) for x in xs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--flood", type=int, default=64)
    ap.add_argument("--flood-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    home = tempfile.mkdtemp(prefix="mlxd-fair-")
    model = args.model
    if model is None:
        from fixtures.tiny_models import make_tiny_chat_model

        model = make_tiny_chat_model(
            Path(home) / "long-llama", "llama", hidden_size=256, num_layers=4,
            max_position_embeddings=8192, seed=1,
        )  # fmt: skip
    env = {
        "MLXD_API_KEYS": ",".join(f"{n}:{k}" for n, k in KEYS.items()),
        "MLXD_ENGINE__MAX_NUM_SEQS": str(args.max_num_seqs),
        "MLXD_ENGINE__MAX_QUEUED_REQUESTS": str(args.flood + 16),
    }
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()  # the code the server runs: read before it starts
    proc, url = start(home, str(model), env)
    name = model.name
    body = {
        "model": name,
        "prompt": "the single request",
        "max_tokens": 8,
        "temperature": 0,
        "logit_bias": eos_ban(model),
    }
    arms: dict[str, list[float]] = {"idle": [], "flood_other_key": [], "flood_same_key": []}
    load_before = os.getloadavg()
    preempted: dict[str, float] = {}
    try:
        ttft(url, KEYS["b"], body)  # warm: the first request's one-off costs
        for i in range(args.repeats):
            arms["idle"].append(ttft(url, KEYS["b"], body))
            arms["flood_other_key"].append(loaded(url, name, args, KEYS["b"], body))
            arms["flood_same_key"].append(loaded(url, name, args, KEYS["a"], body))
            print(i, {k: round(v[-1], 3) for k, v in arms.items()}, flush=True)
        preempted = preemptions(url, name)
    finally:
        stop(proc)
    result = {
        "what": "TTFT of one request of key B: idle server, behind key A's flood (fair "
        "share and fair preemption), and the same request from key A itself (behind its "
        "own flood, FIFO)",
        "command": "python " + " ".join(sys.argv),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores (shared; "
        f"load average {_load(load_before)} before the run, {_load(os.getloadavg())} after)",
        "model": str(args.model) if args.model else "tiny random llama (tests/fixtures)",
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit,
        "settings": {
            "flood": args.flood,
            "flood_max_tokens": args.flood_tokens,
            "max_num_seqs": args.max_num_seqs,
            "repeats": args.repeats,
            "single_max_tokens": body["max_tokens"],
        },
        "ttft": {k: summary(v) for k, v in arms.items()},
        "other_key_over_idle_per_repeat": ratios(arms["flood_other_key"], arms["idle"]),
        "same_key_over_other_key_per_repeat": ratios(
            arms["flood_same_key"], arms["flood_other_key"]
        ),
        "preemptions": preempted,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


def ratios(num: list[float], den: list[float]) -> dict[str, float]:
    """Median and range of ``num[i] / den[i]``: the same repeat's arms, run back to back."""
    rs = [n / d for n, d in zip(num, den, strict=True)]
    return {
        "median": round(statistics.median(rs), 2),
        "min": round(min(rs), 2),
        "max": round(max(rs), 2),
    }


def preemptions(url: str, model: str) -> dict[str, float]:
    """mlxd:preemptions_total by reason, from /metrics."""
    head = f'mlxd:preemptions_total{{model="{model}",reason="'
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(head):
            reason, value = line[len(head) :].split('"} ')
            out[reason] = float(value)
    return out


def _load(avg: tuple[float, float, float]) -> str:
    return "/".join(f"{x:.1f}" for x in avg)


if __name__ == "__main__":
    main()
