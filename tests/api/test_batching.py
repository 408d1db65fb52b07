"""Continuous batching, disconnects and the admission queue, observed through HTTP."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai


def _wait_for(pred, timeout: float = 10.0, every: float = 0.02) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(every)
    return False


def _model_status(srv, name: str) -> dict:
    return next(m for m in srv.health()["models"] if m["name"] == name)


def _steps(srv) -> int:
    """Decode steps long-llama's engine has run (its step counter in /health)."""
    return _model_status(srv, "long-llama")["step_budget"]["steps"]


def _assert_cut_short(srv, before: int) -> None:
    """The request's slot was freed because it was cancelled, not because it ran its 4000
    tokens out: the engine ran far fewer steps than that, and runs no more."""
    ran = _steps(srv) - before
    assert ran < 4000, ran
    assert _steps(srv) - before == ran


def test_sixteen_concurrent_requests_complete_in_one_batch(start_server, long_llama):
    srv = start_server(long_llama, engine={"max_num_seqs": 16})
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)

    async def one(i: int):
        return await client.chat.completions.create(
            model="long-llama",
            messages=[{"role": "user", "content": f"request number {i}"}],
            max_tokens=24,
            temperature=0,
        )

    async def main():
        return await asyncio.gather(*(one(i) for i in range(16)))

    results = asyncio.run(main())
    assert len(results) == 16
    assert all(r.usage.completion_tokens == 24 for r in results)
    assert all(r.choices[0].finish_reason == "length" for r in results)
    st = _model_status(srv, "long-llama")
    assert st["max_batch_size_seen"] > 1, st
    assert st["running"] == 0 and srv.health()["requests_in_flight"] == 0

    # Batched results equal the same request run alone (greedy).
    alone = openai.OpenAI(base_url=srv.url + "/v1", api_key="x").chat.completions.create(
        model="long-llama",
        messages=[{"role": "user", "content": "request number 3"}],
        max_tokens=24,
        temperature=0,
    )
    assert alone.choices[0].message.content == results[3].choices[0].message.content


def test_streaming_disconnect_frees_the_slot(start_server, long_llama):
    srv = start_server(long_llama)
    before = _steps(srv)
    body = {
        "model": "long-llama",
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 4000,
        "stream": True,
    }
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
            assert _model_status(srv, "long-llama")["running"] == 1
        # leaving the block closes the connection mid-stream
    assert _wait_for(lambda: _model_status(srv, "long-llama")["running"] == 0, timeout=60)
    assert _wait_for(lambda: srv.health()["requests_in_flight"] == 0, timeout=60)
    # freed because it was cancelled, not because it ran its 4000 tokens out
    _assert_cut_short(srv, before)


def test_non_streaming_disconnect_frees_the_slot(start_server, long_llama):
    srv = start_server(long_llama)
    before = _steps(srv)
    body = {
        "model": "long-llama",
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 4000,
    }

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            task = asyncio.ensure_future(c.post("/v1/chat/completions", json=body))
            for _ in range(500):
                await asyncio.sleep(0.02)
                if _model_status(srv, "long-llama")["running"] == 1:
                    break
            assert _model_status(srv, "long-llama")["running"] == 1
            task.cancel()  # the client gives up: its connection closes
            try:
                await task
            except asyncio.CancelledError:
                pass

    asyncio.run(main())
    assert _wait_for(lambda: _model_status(srv, "long-llama")["running"] == 0, timeout=60)
    assert _wait_for(lambda: srv.health()["requests_in_flight"] == 0, timeout=60)
    _assert_cut_short(srv, before)


def test_admission_queue_full_is_429_with_retry_after(start_server, long_llama):
    srv = start_server(long_llama, engine={"max_num_seqs": 1, "max_queued_requests": 1})
    body = {"model": "long-llama", "prompt": "x", "max_tokens": 4000, "stream": True}
    with (
        httpx.Client(base_url=srv.url, timeout=30) as c1,
        httpx.Client(base_url=srv.url, timeout=30) as c2,
        httpx.Client(base_url=srv.url, timeout=30) as c3,
    ):
        with (
            c1.stream("POST", "/v1/completions", json=body) as r1,
            c2.stream("POST", "/v1/completions", json=body) as r2,
        ):
            assert r1.status_code == 200 and r2.status_code == 200
            r3 = c3.post("/v1/completions", json={**body, "stream": False})
            assert r3.status_code == 429
            assert r3.headers["retry-after"] == "1"
            err = r3.json()["error"]
            assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
    assert _wait_for(lambda: srv.health()["requests_in_flight"] == 0, timeout=60)
    r = httpx.post(
        srv.url + "/v1/completions",
        json={"model": "long-llama", "prompt": "x", "max_tokens": 2},
        timeout=30,
    )
    assert r.status_code == 200


def test_streaming_disconnect_frees_every_choice(start_server, long_llama):
    srv = start_server(long_llama)
    body = {
        "model": "long-llama",
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 4000,
        "stream": True,
        "n": 2,
        # structured output on both choices; a string no shorter than max_tokens so that
        # neither choice can finish on its own while the test watches (a bare
        # json_object lets a random model close the object after a few tokens)
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "long",
                "schema": {
                    "type": "object",
                    "required": ["text"],
                    "properties": {"text": {"type": "string", "minLength": 4000}},
                },
            },
        },
    }
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(8)]
            assert any(line.startswith("data: ") for line in got)
            assert _wait_for(lambda: _model_status(srv, "long-llama")["running"] == 2, 60)
    assert _wait_for(lambda: _model_status(srv, "long-llama")["running"] == 0, timeout=60)
    assert _wait_for(lambda: srv.health()["requests_in_flight"] == 0, timeout=60)
