"""Where a decode step's wall time goes in mlxd's engine, in-process (no HTTP).

Runs ``LLMEngine`` on B rows of greedy decode with EOS ignored, times each phase of mlx-lm's
``GenerationBatch._step`` (a timed copy of it: graph build in Python, ``async_eval``, the
wait for the previous step's tokens, the host read) and the engine's work around it, then
prints a cProfile of the same loop's hottest functions.

    PYTHONPATH=src python benchmarks/decode_profile.py --model DIR --batch 1,4 --tokens 256

``--graph`` instead counts the operations (MLX primitives) one decode step puts in its
graph, from the graph handed to ``async_eval`` with everything before it evaluated:
mlx-lm's ``generate_step`` (one row), its ``BatchGenerator`` and mlxd's batch. On a GPU
whose decode step is bound by launching kernels, a step costs about its operation count.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections import defaultdict

T: dict[str, float] = defaultdict(float)


def timed_step(self):  # mlx-lm 0.32's GenerationBatch._step with phase timers
    import mlx.core as mx

    t0 = time.perf_counter()
    self._current_tokens = self._next_tokens
    self._current_logprobs = self._next_logprobs
    inputs = self._current_tokens
    logits = self.model(inputs[:, None], cache=self.prompt_cache)
    logits = logits[:, -1, :]
    t1 = time.perf_counter()
    T["build_forward"] += t1 - t1 + (t1 - t0)
    token_context = []
    if any(self.logits_processors):
        processed = []
        for e in range(len(self.uids)):
            sample_logits = logits[e : e + 1]
            processors = self.logits_processors[e] or ()
            if processors:
                context = self._token_context[e].update_and_fetch(inputs[e : e + 1])
                token_context.append(context)
                for processor in processors:
                    sample_logits = processor(context, sample_logits)
            processed.append(sample_logits)
        logits = mx.concatenate(processed, axis=0)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    samplers = [
        self.fallback_sampler if s is None else s
        for s in (self.samplers or [None] * len(self.uids))
    ]
    if not samplers or all(s is samplers[0] for s in samplers):
        sampled = (samplers[0] if samplers else self.fallback_sampler)(logprobs)
    else:
        sampled = mx.concatenate([s(logprobs[e : e + 1]) for e, s in enumerate(samplers)], axis=0)
    self._next_tokens = sampled
    self._next_logprobs = list(logprobs)
    t2 = time.perf_counter()
    T["build_sample"] += t2 - t1
    mx.async_eval(self._next_tokens, self._next_logprobs, token_context)
    t3 = time.perf_counter()
    T["async_eval"] += t3 - t2
    mx.eval(inputs, self._current_logprobs)
    t4 = time.perf_counter()
    T["wait_prev_step"] += t4 - t3
    inputs = inputs.tolist()
    for sti, ti in zip(self.tokens, inputs, strict=False):
        sti.append(ti)
    T["host_read"] += time.perf_counter() - t4
    return inputs, self._current_logprobs


def run(engine, batch: int, tokens: int, profile: cProfile.Profile | None) -> float:
    from mlxd.core.types import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    for i in range(batch):
        engine.add(engine.new_sequence([1 + (7 * i + 3 * j) % 200 for j in range(32)], params))
    gen = engine._gen
    inner = gen.next
    spent = {"gen_next": 0.0}

    def next_timed():
        t = time.perf_counter()
        out = inner()
        spent["gen_next"] += time.perf_counter() - t
        return out

    gen.next = next_timed
    # the prefill steps first: what is timed is decode
    while engine.has_work() and engine.num_waiting:
        engine.step()
    T.clear()
    spent["gen_next"] = 0.0
    steps, t0 = 0, time.perf_counter()
    if profile:
        profile.enable()
    while engine.has_work():
        engine.step()
        steps += 1
    if profile:
        profile.disable()
    wall = time.perf_counter() - t0
    del gen.next
    step = sum(T.values())
    T["batch_next_bookkeeping"] = spent["gen_next"] - step
    T["engine_around_next"] = wall - spent["gen_next"]
    print(f"batch {batch}: {steps} steps, {1000 * wall / steps:.3f} ms/step")
    for k, v in T.items():
        print(f"  {k:24s} {1000 * v / steps:8.3f} ms/step  {100 * v / wall:5.1f}%")
    return wall


def count_ops(*arrays) -> dict[str, int]:
    """The unevaluated primitives behind ``arrays``, by name (MLX's DOT export)."""
    import io
    import re

    import mlx.core as mx

    buf = io.StringIO()
    mx.export_to_dot(buf, *arrays)
    names = re.findall(r'label ="([^"]+)", shape=rectangle', buf.getvalue())
    out: dict[str, int] = defaultdict(int)
    for n in names:
        out[n] += 1
    return dict(out)


def step_graph(gen_next, batch_of) -> dict[str, int]:
    """The operations of one ``gen_next()`` decode step: everything before it evaluated,
    the step's own ``async_eval`` arguments counted."""
    import mlx.core as mx

    b = batch_of()
    mx.eval(b._next_tokens, b._next_logprobs)
    real = mx.async_eval
    seen: list[dict[str, int]] = []

    def capture(*arrays):
        seen.append(count_ops(*arrays))
        return real(*arrays)

    mx.async_eval = capture
    try:
        gen_next()
    finally:
        mx.async_eval = real
    return seen[0]


def graphs(model, batch: int) -> dict[str, dict[str, int]]:
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import make_prompt_cache

    from mlxd.engines.serving_batch import ServingBatchGenerator

    prompts = [[1 + (7 * i + 3 * j) % 200 for j in range(32)] for i in range(batch)]
    out = {}
    if batch == 1:  # generate_step's _step, as it builds it
        cache = make_prompt_cache(model)
        model(mx.array(prompts)[:, :-1], cache=cache)
        y = mx.array([prompts[0][-1]])
        mx.eval(y, [c.state for c in cache])
        logits = model(y[None], cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        out["generate_step"] = count_ops(mx.argmax(logprobs, axis=-1), logprobs.squeeze(0))
    for name, cls in (("mlx_lm_batch", BatchGenerator), ("mlxd_batch", ServingBatchGenerator)):
        gen = cls(model, completion_batch_size=batch, prefill_batch_size=batch)
        gen.insert(prompts, max_tokens=[64] * batch)
        for _ in range(4):
            gen.next()
        out[name] = step_graph(gen.next, lambda g=gen: g._generation_batch)
        gen.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--graph", action="store_true", help="count each step's operations")
    args = ap.parse_args()
    from mlxd import blas

    blas.preload("auto")
    from mlx_lm.generate import GenerationBatch

    from mlxd.engines.llm import LLMEngine

    if args.graph:
        from mlx_lm.utils import load

        model, _ = load(args.model)
        for b in (int(x) for x in args.batch.split(",")):
            for name, ops in graphs(model, b).items():
                top = sorted(ops.items(), key=lambda kv: -kv[1])[:8]
                print(f"batch {b} {name}: {sum(ops.values())} ops/step; most: {top}")
        return
    GenerationBatch._step = timed_step
    engine = LLMEngine("m", args.model)
    engine.eos_token_ids = []  # every row decodes --tokens tokens
    engine.bind()
    engine.warmup()
    for b in (int(x) for x in args.batch.split(",")):
        run(engine, b, args.tokens, None)  # warm
        run(engine, b, args.tokens, None)
        prof = cProfile.Profile()
        run(engine, b, args.tokens, prof)
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
        print("  cProfile (tottime, the profiled run):")
        print("\n".join("   " + x for x in s.getvalue().splitlines()[4:] if x.strip()))


if __name__ == "__main__":
    main()
