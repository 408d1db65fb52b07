"""engine.max_step_tokens through HTTP: a long prompt arriving beside running streams is
prefilled in budgeted steps between their decode steps, so they keep getting tokens, and
it answers what it answers alone."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

MODEL = "long-llama"
BUDGET = 32
STREAMS = 3
WORDS = (
    "ocean garden market river stone lantern winter harbor music library "
    "quiet morning city bridge forest letter"
).split()


def _long_prompt() -> str:
    return " ".join(f"{WORDS[i % len(WORDS)]} {WORDS[(i * 7) % len(WORDS)]}." for i in range(110))


def _budget_stats(srv) -> dict:
    model = next(m for m in srv.health()["models"] if m["name"] == MODEL)
    return model["step_budget"]


def _stream(
    srv, body: dict, stamps: list[float], stop: threading.Event, text: list[str] | None = None
) -> None:
    """POST a streaming chat; a monotonic stamp per content chunk, until done or ``stop``."""
    with (
        httpx.Client(base_url=srv.url, timeout=120) as c,
        c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if stop.is_set() or line == "data: [DONE]":
                return
            if not line.startswith("data: "):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if delta:
                stamps.append(time.monotonic())
                if text is not None:
                    text.append(delta)


def _wait_for(pred, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def _long_beside_streams(srv) -> tuple[dict, dict, list[int], str]:
    """The long prompt alone, then beside ``STREAMS`` decoding streams: its reply alone,
    the step budget's stats between the two, how many tokens each stream got while it
    prefilled, and its text beside them."""
    long = {
        "model": MODEL,
        "messages": [{"role": "user", "content": _long_prompt()}],
        "max_tokens": 12,
        "temperature": 0,
    }
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        alone = c.post("/v1/chat/completions", json=long).json()
    between = _budget_stats(srv)
    stop = threading.Event()
    stamps: list[list[float]] = [[] for _ in range(STREAMS)]
    body = {"model": MODEL, "max_tokens": 4000, "temperature": 0}
    streams = [
        threading.Thread(
            target=_stream,
            daemon=True,
            args=(
                srv,
                {**body, "messages": [{"role": "user", "content": f"story number {i}"}]},
                stamps[i],
                stop,
            ),
        )
        for i in range(STREAMS)
    ]
    for t in streams:
        t.start()
    try:
        assert _wait_for(lambda: all(len(s) >= 3 for s in stamps)), [len(s) for s in stamps]
        first: list[float] = []
        text: list[str] = []
        submitted = time.monotonic()
        _stream(srv, long, first, threading.Event(), text)
        assert first, "the long prompt answered nothing"
        during = [sum(1 for t in s if submitted < t < first[0]) for s in stamps]
    finally:
        stop.set()
        for t in streams:
            t.join(60)
    return alone, between, during, "".join(text)


@pytest.mark.parametrize("mixed", [True, False])
def test_a_long_prompt_beside_streams_is_prefilled_in_budgeted_steps(
    start_server, long_llama, mixed
):
    """With engine.mixed_steps (the default) the budgeted chunks go into the streams'
    decode passes; without it, in passes of their own: the same text either way."""
    srv = start_server(
        long_llama,
        engine={
            "max_step_tokens": BUDGET,
            "max_num_seqs": 8,
            "prefix_cache_bytes": 0,
            "mixed_steps": mixed,
        },
    )
    alone, before, during, text = _long_beside_streams(srv)
    prompt_tokens = alone["usage"]["prompt_tokens"]
    assert prompt_tokens > 25 * BUDGET
    assert before["budget"] == BUDGET
    assert before["mixed"] is mixed
    after = _budget_stats(srv)

    # every stream got tokens while the long prompt was being prefilled
    assert all(n > 0 for n in during), during
    # and the long prompt answered what it answers alone
    assert text == alone["choices"][0]["message"]["content"]
    # no step carried more than the budget, padding and decode rows counted; the long
    # prompt took a step per (budget - decode rows) tokens or more
    assert after["largest_step_tokens"] <= BUDGET, after
    assert after["prefill_steps"] - before["prefill_steps"] >= prompt_tokens // BUDGET
    assert after["prefill_tokens"] - before["prefill_tokens"] >= prompt_tokens
    mixed_steps = after["mixed_steps"] - before["mixed_steps"]
    assert mixed_steps > 0 if mixed else after["mixed_steps"] == 0, after


def test_auto_on_the_cpu_steers_the_budget_and_health_shows_it(start_server, long_llama):
    """`auto` (the default) on the CPU: each step's prefill beside the streams is steered
    from measured step times (engines/step_pace.py); the streams keep getting tokens, the
    long prompt answers what it answers alone, and /health shows the measured figures."""
    srv = start_server(
        long_llama, engine={"max_num_seqs": 8, "prefix_cache_bytes": 0, "prefill_step_size": 64}
    )
    alone, _, during, text = _long_beside_streams(srv)
    stats = _budget_stats(srv)
    assert all(n > 0 for n in during), during
    assert text == alone["choices"][0]["message"]["content"]
    assert stats["adaptive"] is True
    assert stats["decode_step_ms"] > 0
    assert 16 <= stats["prefill_chunk"] <= 2 * 64
    assert stats["largest_prefill_tokens"] <= 2 * 64
