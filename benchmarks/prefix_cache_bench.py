"""Time to first token over a multi-turn chat, prefix cache on vs off.

Starts ``mlxd serve`` twice (the same model; ``engine.prefix_cache_bytes`` default vs 0),
and in each plays the same conversations: every turn resends the whole history (system
prompt, earlier questions and the model's own answers) plus a new question, as chat
clients and agents do. Reports per turn the prompt length, the tokens served from the
prefix cache (``usage.prompt_tokens_details.cached_tokens``) and the TTFT (first content
chunk of a streamed, greedy completion), medians over the conversations.

    python benchmarks/prefix_cache_bench.py --turns 10 --conversations 3 --max-tokens 32

The model is the built-in default (SmolLM2-135M-Instruct, loaded from the store, the hub or
its PyPI wheel); ``--model`` picks another, ``--home`` the MLXD_HOME to use.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import time
from pathlib import Path

import httpx
import mlxd_proc

TOPICS = [
    "the ocean",
    "mountains",
    "old libraries",
    "trains",
    "gardens",
    "the moon",
    "bread baking",
    "rivers",
    "winter",
    "jazz music",
]
ASKS = [
    "Tell me something interesting about {t}.",
    "Why do people like {t} so much?",
    "Can you give me three facts about {t}, each in one sentence?",
    "What would a child ask about {t}? Answer that question too.",
    "Write a short poem of four lines about {t}.",
    "What is a common myth about {t}?",
    "How has {t} changed over the last hundred years?",
    "Explain {t} to someone who has never heard of it.",
    "What questions remain open about {t}?",
    "Summarise our conversation so far.",
]
FILLER = (
    "Please answer carefully and stay on topic; I am taking notes for a school project "
    "and want clear, simple sentences that a ten year old could follow. "
)


def start(home: str, model: str, cache_bytes: int | None) -> tuple[subprocess.Popen, str]:
    env = {} if cache_bytes is None else {"MLXD_ENGINE__PREFIX_CACHE_BYTES": str(cache_bytes)}
    return mlxd_proc.start(home, model, env, timeout=300)


def turn(
    client: httpx.Client, url: str, model: str, messages: list[dict], max_tokens: int
) -> tuple[float, str, dict]:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = None
    text: list[str] = []
    usage: dict = {}
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
    return ttft if ttft is not None else time.perf_counter() - t0, "".join(text), usage


def conversation(url: str, model: str, topic: str, turns: int, max_tokens: int) -> list[dict]:
    messages = [
        {
            "role": "system",
            "content": f"You are a friendly tutor. Today's topic is {topic}. Keep answers short.",
        }
    ]
    rows = []
    with httpx.Client(timeout=600) as client:
        for k in range(turns):
            messages.append(
                {"role": "user", "content": FILLER + ASKS[k % len(ASKS)].format(t=topic)}
            )
            ttft, text, usage = turn(client, url, model, messages, max_tokens)
            messages.append({"role": "assistant", "content": text})
            rows.append(
                {
                    "turn": k + 1,
                    "ttft": ttft,
                    "prompt_tokens": usage.get("prompt_tokens"),
                    "cached_tokens": (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens", 0
                    ),
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--home", default=os.environ.get("MLXD_HOME") or str(Path.home() / ".mlxd"))
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=None, help="write the raw rows as JSON here")
    args = ap.parse_args()
    rng = random.Random(0)
    topics = rng.sample(TOPICS, args.conversations)
    results: dict[str, list[list[dict]]] = {}
    for label, cache in (("cache on", None), ("cache off", 0)):
        proc, url = start(args.home, args.model, cache)
        try:
            results[label] = [
                conversation(url, args.model, t, args.turns, args.max_tokens) for t in topics
            ]
        finally:
            mlxd_proc.stop(proc, 60)
    print(
        f"model {args.model}, {args.conversations} conversations x {args.turns} turns, "
        f"{args.max_tokens} tokens per answer, greedy; medians"
    )
    print(
        "| turn | prompt tokens | cached (on) | TTFT cache on (s) | TTFT cache off (s) | speed-up |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for k in range(args.turns):
        on = [c[k] for c in results["cache on"]]
        off = [c[k] for c in results["cache off"]]
        t_on = statistics.median(r["ttft"] for r in on)
        t_off = statistics.median(r["ttft"] for r in off)
        print(
            f"| {k + 1} | {statistics.median(r['prompt_tokens'] for r in off):.0f} "
            f"| {statistics.median(r['cached_tokens'] for r in on):.0f} "
            f"| {t_on:.3f} | {t_off:.3f} | {t_off / t_on:.1f}x |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
