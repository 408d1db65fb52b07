"""engine.pipeline_decode through HTTP: a server that evaluates each decode step before
building the next ('off') answers what the pipelined one ('auto': on) does."""

from __future__ import annotations

import asyncio

import httpx
import openai
from conftest import wait_until


def _ask(srv, **kw) -> dict:
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": kw.pop("content", "tell me about rivers")}],
        "temperature": 0,
        **kw,
    }
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return {
        "text": choice["message"]["content"],
        "finish": choice["finish_reason"],
        "logprobs": choice.get("logprobs"),
        "tokens": r.json()["usage"]["completion_tokens"],
    }


def _answers(srv, stop: str | None) -> list[dict]:
    out = [
        _ask(srv, max_tokens=1),
        _ask(srv, max_tokens=12, logprobs=True, top_logprobs=3),
        _ask(srv, max_tokens=16, content="a city of music"),
    ]
    if stop is not None:
        out.append(_ask(srv, max_tokens=16, content="a city of music", stop=[stop]))
    return out


def test_stepwise_decode_answers_as_the_pipelined_one(start_server, tiny_llama):
    """One request at a time (the same batch on both): max_tokens=1, logprobs with their
    top alternatives, a stop string cutting the reply mid-way."""
    on = start_server(tiny_llama)
    off = start_server(tiny_llama, engine={"pipeline_decode": "off"})
    first = _answers(on, None)
    long_text = first[2]["text"]
    assert first[0]["tokens"] == 1 and first[0]["finish"] == "length"
    assert len(long_text) > 6, long_text
    stop = long_text[len(long_text) // 2 : len(long_text) // 2 + 3]
    ours, theirs = _answers(on, stop), _answers(off, stop)
    assert ours == theirs
    assert ours[3]["finish"] == "stop" and stop not in ours[3]["text"]
    assert ours[1]["logprobs"]["content"][0]["top_logprobs"]


def test_stepwise_decode_serves_mixed_finishes_arrivals_and_a_cancel(start_server, long_llama):
    """With pipeline_decode off, concurrent rows ending at different lengths, one arriving
    while others stream and one stream dropped mid-way all end as they should, and the
    engine is idle afterwards."""
    srv = start_server(long_llama, engine={"pipeline_decode": "off", "max_num_seqs": 8})
    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)

    async def one(i: int, n: int):
        return await client.chat.completions.create(
            model="long-llama",
            messages=[{"role": "user", "content": f"request {i}"}],
            max_tokens=n,
            temperature=0,
        )

    async def dropped() -> int:
        seen = 0
        stream = await client.chat.completions.create(
            model="long-llama",
            messages=[{"role": "user", "content": "a long story"}],
            max_tokens=4000,
            temperature=0,
            stream=True,
        )
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.close()
        return seen

    async def late():
        await asyncio.sleep(0.05)
        return await one(99, 7)

    async def main():
        return await asyncio.gather(
            *(one(i, n) for i, n in enumerate((1, 3, 9))), dropped(), late()
        )

    *done, seen, arrived = asyncio.run(main())
    assert [r.usage.completion_tokens for r in done] == [1, 3, 9]
    assert all(r.choices[0].finish_reason == "length" for r in done)
    assert arrived.usage.completion_tokens == 7 and seen == 3

    def idle() -> bool:
        model = next(m for m in srv.health()["models"] if m["name"] == "long-llama")
        return model["running"] == 0 and srv.health()["requests_in_flight"] == 0

    assert wait_until(idle)
