"""Batch slots per model through HTTP: ``engine.max_num_seqs: auto`` sizes each model's batch
from the memory budget at load, /health says what it chose and why, and admission follows
the chosen figure; a number is used as it is."""

from __future__ import annotations

import contextlib

import httpx
from conftest import wait_until

from mlxd.runtime.memory import estimate_model_bytes

# long-llama's KV: 4 layers x 8 KV heads x head dim 16 x (k, v) x float32, per token
LONG_KV_PER_TOKEN = 4 * 8 * 16 * 2 * 4
SEQ_TOKENS = 1024  # engine.auto_seq_context in these tests: 4 MiB a sequence


def _model(srv, name: str) -> dict:
    return next(m for m in srv.health()["models"] if m["name"] == name)


def _budget_for(path, seqs: float) -> int:
    """A memory budget that leaves room for ``seqs`` sequences once the weights and the
    10% kept for activations are counted (the prefix cache is off in these servers)."""
    weights = estimate_model_bytes(path, upcast_half=True)
    return weights + int(seqs * LONG_KV_PER_TOKEN * SEQ_TOKENS / 0.9)


def _auto_server(start_server, path, budget: int | None, **engine):
    return start_server(
        path,
        models={"memory_budget_bytes": budget},
        engine={"prefix_cache_bytes": 0, "auto_seq_context": SEQ_TOKENS, **engine},
    )


def test_auto_reports_the_chosen_batch_and_why(start_server, tiny_llama):
    """By default (auto), a tiny model on a big budget gets the backend's cap, and /health
    says so with the figures it came from."""
    srv = start_server(tiny_llama)
    m = _model(srv, "tiny-llama")
    cap = 32 if srv.runtime.backend == "cpu" else 256
    assert m["max_num_seqs"] == cap
    reason = m["max_num_seqs_reason"]
    assert reason.startswith("auto: ") and "free for KV (budget " in reason
    # tiny-llama: 2 layers x 2 KV heads x 16 x (k, v) x float32; its context is 256 tokens
    assert "/ 512 B per token / 256 tokens -> " in reason
    assert reason.endswith(f"-> {cap} (cap {cap})")


def test_a_small_budget_gives_fewer_slots_and_admission_follows_them(start_server, long_llama):
    """Room for 10.5 sequences: 10 slots (a big budget: the cap). With no queue, 10
    requests run and the 11th is turned away with 429, not 32 + queue as a fixed default
    would admit."""
    small = _auto_server(
        start_server, long_llama, _budget_for(long_llama, 10.5), max_queued_requests=0
    )
    large = _auto_server(start_server, long_llama, _budget_for(long_llama, 1000))
    s, big = _model(small, "long-llama"), _model(large, "long-llama")
    assert s["max_num_seqs"] == 10, s["max_num_seqs_reason"]
    assert f"/ 4.0 KiB per token / {SEQ_TOKENS} tokens -> 10 (cap" in s["max_num_seqs_reason"]
    assert big["max_num_seqs"] > s["max_num_seqs"]
    assert "fit ->" in big["max_num_seqs_reason"] and "(cap " in big["max_num_seqs_reason"]

    body = {"model": "long-llama", "prompt": "x", "max_tokens": 4000, "stream": True}
    with contextlib.ExitStack() as stack:
        c = stack.enter_context(httpx.Client(base_url=small.url, timeout=60))
        for _ in range(10):
            r = stack.enter_context(c.stream("POST", "/v1/completions", json=body))
            assert r.status_code == 200
        extra = httpx.post(
            small.url + "/v1/completions", json={**body, "stream": False}, timeout=60
        )
        assert extra.status_code == 429, extra.text
        assert extra.json()["error"]["code"] == "queue_full"
        # the core counts each stream once its Add has arrived (the 200 can come first)
        counted = wait_until(lambda: _in_batch(small) == 10)
        assert counted, _model(small, "long-llama")
    assert wait_until(lambda: not small.health()["requests_in_flight"], 30)
    ok = httpx.post(
        small.url + "/v1/completions",
        json={"model": "long-llama", "prompt": "x", "max_tokens": 2},
        timeout=60,
    )
    assert ok.status_code == 200


def test_a_number_is_used_as_it_is_per_model_too(start_server, tiny_llama, tiny_qwen2):
    srv = start_server(
        tiny_llama,
        engine={"max_num_seqs": 5},
        models={"preload": [str(tiny_qwen2)], "options": {"tiny-qwen2": {"max_num_seqs": 3}}},
    )
    llama, qwen = _model(srv, "tiny-llama"), _model(srv, "tiny-qwen2")
    assert (llama["max_num_seqs"], llama["max_num_seqs_reason"]) == (5, "engine.max_num_seqs: 5")
    assert (qwen["max_num_seqs"], qwen["max_num_seqs_reason"]) == (
        3,
        "models.options.tiny-qwen2.max_num_seqs: 3",
    )
    with srv.client() as c:
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": "tiny-qwen2",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
            },
        )
    assert r.status_code == 200, r.text


def _in_batch(srv) -> int:
    m = _model(srv, "long-llama")
    return m["running"] + m["waiting"]
