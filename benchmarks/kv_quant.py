"""A quantized KV cache (engine.kv_bits 4 and 8) against full precision on one text model.

In process, through the engine's own cache classes (engines/kv_quant.py):

* quality: for each prompt the full-precision model's greedy continuation (``--gen``
  tokens) is the reference; each width then runs the same prompt and continuation through
  a quantized batch cache of one row (prefill in chunks, then one token a step, teacher
  forced) and compares, at every continuation position, the log-probability it gives the
  reference token (mean and max absolute difference) and whether its argmax is that
  token (greedy agreement);
* memory: KV bytes per token (engine's /health figure) and what ``max_num_seqs: auto``
  picks at a fixed budget (core/slots.py);
* speed: decode tokens per second at ``--concurrency`` levels (``LLMEngine`` steps after every row
  has its first token), the widths interleaved, ``--pairs`` rounds.

    python benchmarks/kv_quant.py --model-dir ~/.mlxd/models/smollm2-135m-instruct \\
        --prompts 64 --out docs/results/cpu-kv-quant-2026-12-04.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from mlxd import blas  # noqa: E402

BLAS = blas.preload("auto")  # before MLX: its bundled reference BLAS is ~20x slower

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import BatchKVCache  # noqa: E402

from mlxd.core import slots  # noqa: E402
from mlxd.core.types import SamplingParams  # noqa: E402
from mlxd.engines.kv_quant import QuantizedBatchKVCache  # noqa: E402
from mlxd.engines.llm import LLMEngine  # noqa: E402
from mlxd.engines.options import TextEngineOptions  # noqa: E402

WIDTHS = (None, 8, 4)
# Real, varied English (the standard library's own documentation), so the prompts are not one
# sentence repeated: a repeated text makes every position easy and hides quantization error.
CORPUS_MODULES = (
    "argparse",
    "asyncio",
    "collections",
    "csv",
    "datetime",
    "decimal",
    "email",
    "fractions",
    "functools",
    "heapq",
    "http.client",
    "inspect",
    "itertools",
    "json",
    "logging",
    "pathlib",
    "pickle",
    "queue",
    "random",
    "re",
    "shutil",
    "socket",
    "sqlite3",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "typing",
    "unittest",
    "urllib.request",
    "uuid",
    "zipfile",
)


def corpus() -> list[str]:
    """Paragraphs of the standard library's docstrings, in a fixed order."""
    import importlib
    import inspect

    out: list[str] = []
    for name in CORPUS_MODULES:
        mod = importlib.import_module(name)
        docs = [inspect.getdoc(mod) or ""]
        for attr in sorted(dir(mod)):
            if not attr.startswith("_"):
                docs.append(inspect.getdoc(getattr(mod, attr, None)) or "")
        for doc in docs:
            out += [p.strip() for p in doc.split("\n\n") if len(p.strip()) > 80]
    return list(dict.fromkeys(out))


def prompts(n: int, tokens_of, lo: int = 1024, hi: int = 4096) -> list[list[int]]:
    """``n`` prompts of ``lo``-``hi`` tokens (spread evenly): consecutive documentation
    paragraphs from a different starting point each, cut to length, then a question."""
    paras = corpus()
    sizes = [len(tokens_of(p)) for p in paras]
    question = tokens_of("\n\nWhich of the functions described above would you use first, and why?")
    out = []
    for i in range(n):
        want = lo + (hi - lo) * i // max(n - 1, 1)
        j = (i * 7919) % len(paras)
        text, got = [], 0
        while got < want + 64:  # overshoot, then cut to exactly ``want`` tokens
            text.append(paras[j % len(paras)])
            got += sizes[j % len(paras)] + 1
            j += 1
        body = tokens_of("\n\n".join(text))[: want - len(question)]
        out.append(body + question)
    return out


class RoundedKVCache(BatchKVCache):
    """A plain batch cache whose keys and values are rounded to ``dtype`` as they are
    stored: the error of a 16-bit cache (what a GPU server holds by default) against a
    float32 one, for scale."""

    def __init__(self, left_padding: list[int], dtype: mx.Dtype) -> None:
        super().__init__(left_padding)
        self.round_to = dtype

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        t = keys.dtype
        return super().update_and_fetch(
            keys.astype(self.round_to).astype(t), values.astype(self.round_to).astype(t)
        )


def cache_for(model, bits: int | str | None) -> list:
    """A batch cache of one row per layer: plain (None), quantized (4, 8) or rounded to
    16 bits ("bf16", "fp16")."""
    n = len(model.layers)
    if bits is None:
        return [BatchKVCache([0]) for _ in range(n)]
    if isinstance(bits, str):
        dtype = {"bf16": mx.bfloat16, "fp16": mx.float16}[bits]
        return [RoundedKVCache([0], dtype) for _ in range(n)]
    return [QuantizedBatchKVCache([0], bits, 64) for _ in range(n)]


def forced(model, ids: list[int], cont: list[int], bits: int | None) -> tuple[list, list]:
    """Log-probabilities of ``cont`` after ``ids`` and the argmax at each position."""
    cache = cache_for(model, bits)
    seq = ids + cont
    step = 512
    body = getattr(model, "model", model)  # the layers without the vocabulary head
    for s in range(0, len(ids) - 1, step):
        body(mx.array([ids[s : min(s + step, len(ids) - 1)]]), cache=cache)
        mx.eval([c.state for c in cache])
    lps, top = [], []
    for j in range(len(ids) - 1, len(seq) - 1):
        logits = model(mx.array([[seq[j]]]), cache=cache)[0, -1].astype(mx.float32)
        lp = logits - mx.logsumexp(logits)
        mx.eval(lp)
        lps.append(lp[seq[j + 1]].item())
        top.append(int(mx.argmax(lp).item()))
    return lps, top


def reference(model, ids: list[int], n: int) -> tuple[list[int], list[float], list[float]]:
    """The full-precision greedy continuation, its log-probabilities and at each position
    the margin between its top two log-probabilities (one pass)."""
    cache = cache_for(model, None)
    out, lps, margins = [], [], []
    body = getattr(model, "model", model)
    for s in range(0, len(ids) - 1, 512):  # the head runs on the last position only
        body(mx.array([ids[s : min(s + 512, len(ids) - 1)]]), cache=cache)
        mx.eval([c.state for c in cache])
    x = ids[-1:]
    for _ in range(n):
        logits = model(mx.array([x]), cache=cache)[0, -1].astype(mx.float32)
        lp = logits - mx.logsumexp(logits)
        t = int(mx.argmax(lp).item())
        top2 = sorted(mx.topk(lp, 2).tolist(), reverse=True)
        out.append(t)
        lps.append(lp[t].item())
        margins.append(top2[0] - top2[1])
        x = [t]
    return out, lps, margins


def quality(engine: LLMEngine, ps: list[list[int]], gen: int, widths: list, progress=None) -> dict:
    """Teacher-forced comparison per width, over the prompts done so far (``progress`` is
    called with the summary after each prompt)."""
    model = engine.model
    stats = {b: {"abs": [], "agree": 0, "n": 0, "ties": []} for b in widths}
    lengths: list[int] = []
    margins: list[float] = []

    def summary() -> dict:
        return {
            "prompts_done": len(lengths),
            "prompt_tokens_done": {"min": min(lengths), "max": max(lengths)},
            # how many reference positions a small change can flip: top-two margin in nats
            "reference_margin_under": {
                str(m): sum(x < m for x in margins) for m in (0.01, 0.02, 0.05)
            },
            **{
                str(b): {
                    "mean_abs_logprob_diff": statistics.fmean(s["abs"]),
                    "max_abs_logprob_diff": max(s["abs"]),
                    "greedy_agreement": s["agree"] / s["n"],
                    "positions": s["n"],
                    # the reference's top-two margin where this width's argmax differs
                    "differing_reference_margins": sorted(round(x, 4) for x in s["ties"]),
                }
                for b, s in stats.items()
            },
        }

    for i, ids in enumerate(ps):
        ref_cont, ref_lp, ref_margin = reference(model, ids, gen)
        margins += ref_margin
        for b in stats:
            lp, top = forced(model, ids, ref_cont, b)
            stats[b]["abs"] += [abs(a - r) for a, r in zip(lp, ref_lp, strict=True)]
            stats[b]["agree"] += sum(t == r for t, r in zip(top, ref_cont, strict=True))
            stats[b]["ties"] += [
                m for t, r, m in zip(top, ref_cont, ref_margin, strict=True) if t != r
            ]
            stats[b]["n"] += len(ref_cont)
        lengths.append(len(ids))
        print(f"quality {i + 1}/{len(ps)}", file=sys.stderr, flush=True)
        if progress is not None:
            progress(summary())
    return summary()


def decode_rate(engine: LLMEngine, ps: list[list[int]], c: int, n: int) -> float:
    """Decode tokens per second of ``c`` rows once every row has its first token."""
    seqs = [
        engine.new_sequence(ps[i % len(ps)], SamplingParams(temperature=0.0, max_tokens=n))
        for i in range(c)
    ]
    for s in seqs:
        engine.add(s)
    started: set[int] = set()
    t0, counted = None, 0
    while not all(s.finished for s in seqs):
        if not engine.has_work():  # newcomers held back for a group (GPU): until they are due
            time.sleep(max(0.0, (engine.next_deadline() or time.monotonic()) - time.monotonic()))
            continue
        out = engine.step()
        for s, _ in out:
            if id(s) in started and t0 is not None:
                counted += 1
            started.add(id(s))
        if t0 is None and len(started) == c:
            t0 = time.perf_counter()
    return counted / (time.perf_counter() - t0) if t0 and counted else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--gen", type=int, default=24, help="reference continuation tokens")
    ap.add_argument("--pairs", type=int, default=10, help="interleaved speed rounds")
    ap.add_argument("--speed-tokens", type=int, default=32)
    ap.add_argument("--budget-gib", type=float, default=4.0)
    ap.add_argument("--prompt-tokens", default="1024-4096", help="quality prompts' range, LO-HI")
    ap.add_argument("--concurrency", default="1,16,64", help="speed levels")
    ap.add_argument(
        "--quality-widths",
        default="8,4",
        help="quality: kv_bits to compare, and bf16/fp16 (a cache rounded to 16 bits)",
    )
    ap.add_argument("--skip", choices=("quality", "speed"), action="append", default=[])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    lo, hi = (int(x) for x in args.prompt_tokens.split("-"))

    engines = {
        b: LLMEngine("m", args.model_dir, TextEngineOptions(kv_bits=b, max_num_seqs=max(levels)))
        for b in WIDTHS
    }
    for e in engines.values():
        e.bind()
    base = engines[None]
    ps = prompts(args.prompts, base.encode_prompt, lo, hi)
    lengths = sorted(len(p) for p in ps)
    result: dict = {
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpu_count": __import__("os").cpu_count(),
        "mlx": mx.__version__,
        "blas": f"{BLAS.name} {BLAS.version}".strip(),
        "device": str(mx.default_device()),
        "commit": subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip(),
        "model": str(args.model_dir),
        "prompt_tokens": {
            "min": lengths[0],
            "median": lengths[len(lengths) // 2],
            "max": lengths[-1],
            "count": len(ps),
        },
    }
    config = slots.read_config(args.model_dir)
    budget = int(args.budget_gib * (1 << 30))
    weight_bytes = base.nbytes
    memory = {}
    for b, e in engines.items():
        per_token = e.kv_bytes_per_token()
        per_seq = slots.kv_bytes_per_sequence(config, 4096, 4, b)  # float32 on the CPU
        pick = slots.auto_max_num_seqs(
            budget=budget,
            weight_bytes=weight_bytes,
            prefix_cache_bytes=0,
            kv_bytes_per_seq=per_seq,
            seq_tokens=4096,
            cap=10**6,
        )
        memory[str(b)] = {"kv_bytes_per_token": per_token, "max_num_seqs_auto": pick.value}
    result["memory"] = {
        "budget_bytes": budget,
        "seq_tokens": 4096,
        "uncapped": True,
        "config_layers": config.get("num_hidden_layers"),
        "by_bits": memory,
    }
    print(json.dumps(result["memory"]), file=sys.stderr, flush=True)
    save(result, args.out)

    def progress(q: dict) -> None:
        result["quality"] = q
        save(result, args.out)

    if "quality" not in args.skip:
        widths = [w if w in ("bf16", "fp16") else int(w) for w in args.quality_widths.split(",")]
        result["quality"] = quality(base, ps, args.gen, widths, progress)
        print(json.dumps(result["quality"]), file=sys.stderr, flush=True)
        save(result, args.out)
    if "speed" in args.skip:
        return
    speed: dict = {str(b): {str(c): [] for c in levels} for b in WIDTHS}
    short = [p[:64] for p in ps]
    for r in range(args.pairs):
        order = WIDTHS if r % 2 == 0 else tuple(reversed(WIDTHS))
        for c in levels:
            for b in order:
                speed[str(b)][str(c)].append(decode_rate(engines[b], short, c, args.speed_tokens))
        print(f"speed round {r + 1}/{args.pairs}", file=sys.stderr, flush=True)
        result["decode_tok_s"] = speed_summary(speed)
        result["speed_rounds_done"] = r + 1
        save(result, args.out)
    result["speed_method"] = (
        f"{args.pairs} interleaved rounds (order alternating), prompts cut to 64 tokens, "
        f"{args.speed_tokens} greedy tokens a row, rate counted after every row's first token"
    )
    save(result, args.out)
    print(json.dumps(result, indent=2))


def save(result: dict, out: Path | None) -> None:
    """Write what is measured so far (a long run stopped early keeps its finished parts)."""
    if out is not None:
        out.write_text(json.dumps(result, indent=2) + "\n")


def speed_summary(speed: dict) -> dict:
    return {
        b: {
            c: {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": v}
            for c, v in by_c.items()
            if v
        }
        for b, by_c in speed.items()
    }


if __name__ == "__main__":
    main()
