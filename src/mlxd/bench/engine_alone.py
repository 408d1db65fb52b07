"""The engine alone: mlx-lm's ``BatchGenerator`` driven directly, no HTTP, no server.

``mlxd bench --peer engine`` runs this module in a process of its own (engine_peer.py), so
the model stays loaded across passes and MLX never enters the benchmark's own process:
``python -m mlxd.bench.engine_alone MODEL_DIR OPTIONS_JSON`` prints ``READY <json>`` once
loaded, then answers each JSON line on stdin (a pass: prompts, concurrency, max_tokens)
with one ``RESULT <json>`` line of per-request figures that ``load.summarise`` sums up.
"""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from typing import Any, cast


def encode(tokenizer: Any, prompt: str) -> list[int]:
    """One user message through the chat template, as mlxd's chat endpoint renders it."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(ids, dict):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def closed_loop(
    model: Any,
    tokenizer: Any,
    prompt_ids: list[list[int]],
    concurrency: int,
    max_tokens: int,
    stream: Any = None,
) -> tuple[dict[int, list[tuple[int, float, str | None]]], dict[int, float], float]:
    """``concurrency`` clients in a closed loop, greedy, on one ``BatchGenerator``.

    Client i owns the i-th slice of ``prompt_ids`` (as load.run_pass splits them); when a
    row finishes, its client's next prompt is inserted in the same turn. Returns each
    request's rows (token, time, finish reason), its insertion time, and the pass's wall
    time.
    """
    from mlx_lm.generate import BatchGenerator

    eos = sorted(tokenizer.eos_token_ids)
    per_client = -(-len(prompt_ids) // concurrency)
    queues = [
        deque(range(i * per_client, min((i + 1) * per_client, len(prompt_ids))))
        for i in range(concurrency)
    ]
    gen = BatchGenerator(
        model,
        max_tokens=max_tokens,
        stop_tokens=[[e] for e in eos],
        completion_batch_size=max(concurrency, 1),
        prefill_batch_size=min(8, concurrency),
        stream=stream,
    )
    client_of: dict[int, int] = {}
    request_of: dict[int, int] = {}
    inserted: dict[int, float] = {}
    rows: dict[int, list[tuple[int, float, str | None]]] = {}

    def insert(client: int) -> None:
        if not queues[client]:
            return
        k = queues[client].popleft()
        (uid,) = gen.insert([prompt_ids[k]], max_tokens=[max_tokens])
        client_of[uid], request_of[uid] = client, k
        inserted[k], rows[k] = time.perf_counter(), []

    done = 0
    t0 = time.perf_counter()
    try:
        for client in range(concurrency):
            insert(client)
        while done < len(prompt_ids):
            for r in gen.next_generated():
                now = time.perf_counter()
                rows[request_of[r.uid]].append((int(r.token), now, r.finish_reason))
                if r.finish_reason is not None:
                    done += 1
                    insert(client_of[r.uid])
    finally:
        gen.close()
    return rows, inserted, time.perf_counter() - t0


def request_result(
    tokenizer: Any, rows: list[tuple[int, float, str | None]], inserted: float, prompt_tokens: int
) -> dict[str, Any]:
    """One request as a streaming client would have seen it (load.one_request's keys).

    Times are those of the tokens that made text visible, found by replaying the
    detokenizer after the pass (no cost inside the loop): an EOS shows nothing, nor does a
    byte-level token that completes no character. Every token counts, the EOS included, as
    in mlxd's usage.
    """
    d = tokenizer.detokenizer
    stamps = []
    for token, at, finish in rows:
        if finish == "stop":
            d.finalize()
        else:
            d.add_token(token)
            if finish is not None:
                d.finalize()
        if d.last_segment:
            stamps.append(at)
    if not stamps:
        return {"error": "no text in the reply"}
    return {
        "ttft": stamps[0] - inserted,
        "gaps": [b - a for a, b in zip(stamps, stamps[1:], strict=False)],
        "tokens": len(rows),
        "prompt_tokens": prompt_tokens,
        "finish_reason": rows[-1][2],
        "latency": rows[-1][1] - inserted,
    }


def run_pass(
    model: Any, tokenizer: Any, prompts: list[str], concurrency: int, max_tokens: int, stream: Any
) -> dict[str, Any]:
    ids = [encode(tokenizer, p) for p in prompts]
    rows, inserted, wall = closed_loop(model, tokenizer, ids, concurrency, max_tokens, stream)
    results = [request_result(tokenizer, rows[k], inserted[k], len(ids[k])) for k in rows]
    return {"results": results, "wall_s": wall}


def main(model_dir: str, options: dict[str, Any]) -> None:
    from mlxd import blas

    info = blas.preload(options.get("blas", "auto"))  # before anything imports MLX
    import mlx.core as mx
    from mlx_lm.utils import load

    from mlxd.engines.backend import apply_dtype, backend_name

    trust = bool(options.get("trust_remote_code", False))
    loaded = load(
        model_dir,
        return_config=True,
        trust_remote_code=trust,
        tokenizer_config={"trust_remote_code": trust},
    )
    model, tokenizer, config = cast("tuple[Any, Any, dict[str, Any]]", loaded)
    dtype = apply_dtype(model, config, options.get("dtype", "auto"))
    # the default device's own stream: mlx-lm's generation stream is not the CPU's
    stream = mx.default_stream(mx.default_device())
    ready = {
        "backend": backend_name(),
        "blas": info.describe(),
        "dtype": dtype,
    }
    print("READY " + json.dumps(ready), flush=True)
    for line in sys.stdin:
        q = json.loads(line)
        out = run_pass(model, tokenizer, q["prompts"], q["concurrency"], q["max_tokens"], stream)
        print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
