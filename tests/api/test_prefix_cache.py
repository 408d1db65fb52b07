"""The prefix cache: hits are reported in usage and never change greedy output."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

SYSTEM = {"role": "system", "content": "You are a helpful assistant. " * 12}


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def uncached(tmp_path_factory, tool_qwen2):
    from conftest import LiveServer, make_settings

    srv = LiveServer(
        make_settings(
            tmp_path_factory.mktemp("nocache"), tool_qwen2, engine={"prefix_cache_bytes": 0}
        )
    ).start()
    yield srv
    srv.stop()


def _chat(client, messages, **kw):
    r = client.chat.completions.create(
        model="tool-qwen2",
        messages=messages,
        temperature=0,
        max_tokens=kw.pop("max_tokens", 12),
        **kw,
    )
    return r.choices[0].message.content, r.usage


def test_multi_turn_hits_the_cache_and_matches_an_uncached_server(agent_server, uncached):
    cached, plain = _client(agent_server), _client(uncached)
    history = [SYSTEM, {"role": "user", "content": "Tell me about the sea."}]
    prev_prompt = 0
    for turn in range(3):
        a, ua = _chat(cached, history)
        b, ub = _chat(plain, history)
        assert a == b, f"turn {turn}"
        assert ua.prompt_tokens == ub.prompt_tokens
        assert ub.prompt_tokens_details.cached_tokens == 0
        if turn:
            # everything up to this turn's new user message came from the cache
            assert ua.prompt_tokens_details.cached_tokens > prev_prompt
        history += [
            {"role": "assistant", "content": a},
            {"role": "user", "content": f"And then? ({turn})"},
        ]
        prev_prompt = ua.prompt_tokens
    # the very same request again: all but the last prompt token cached, same answer
    again, u = _chat(cached, history[:2])
    assert again == _chat(plain, history[:2])[0]
    assert u.prompt_tokens_details.cached_tokens == u.prompt_tokens - 1
    stats = next(m for m in agent_server.health()["models"] if m["name"] == "tool-qwen2")
    assert stats["prefix_cache"]["hits"] > 0 and stats["prefix_cache"]["bytes"] > 0


def test_concurrent_hits_in_one_batch(agent_server, uncached):
    cached, plain = _client(agent_server), _client(uncached)
    asks = [[SYSTEM, {"role": "user", "content": f"Question number {i}?"}] for i in range(6)]
    _chat(cached, asks[0])  # leaves the shared system prompt in the cache
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda m: _chat(cached, m, max_tokens=8), asks))
    want = [_chat(plain, m, max_tokens=8)[0] for m in asks]
    assert [g[0] for g in got] == want
    assert all(u.prompt_tokens_details.cached_tokens >= 40 for _, u in got)


def test_the_cache_is_bounded(start_server, tool_qwen2):
    srv = start_server(tool_qwen2, engine={"prefix_cache_bytes": 200_000, "warmup": False})
    c = _client(srv)
    for i in range(6):
        _chat(c, [{"role": "user", "content": f"Different prompt {i} " * 8}])
    (m,) = srv.health()["models"]
    assert 0 < m["prefix_cache"]["bytes"] <= 200_000
    assert m["prefix_cache"]["entries"] < 6


def test_one_off_prompts_never_evict_a_conversation(start_server, tool_qwen2):
    """A full memory tier takes only sequences that show reuse: a flood of one-off prompts
    is turned away (their KV never copied) and a conversation's prefix survives it; a
    conversation starting while the tier is full gets in with its second turn."""
    budget = 64_000  # about three of these exchanges (512 bytes of KV per token here)
    srv = start_server(
        tool_qwen2,
        engine={"prefix_cache_bytes": budget, "warmup": False, "prefix_cache_min_tokens": 24},
    )
    c = _client(srv)

    def stats() -> dict:
        (m,) = srv.health()["models"]
        return m["prefix_cache"]

    def turn(history: list[dict]) -> int:
        text, usage = _chat(c, history, max_tokens=8)
        history += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"Go on, please ({len(history)})."},
        ]
        return usage.prompt_tokens_details.cached_tokens

    sea = [
        {
            "role": "user",
            "content": "Tell me about the sea, its tides and its waves, "
            "and the ships that sail on it.",
        }
    ]
    assert turn(sea) == 0
    for i in range(8):
        _chat(
            c,
            [
                {
                    "role": "user",
                    "content": f"Question {i}: what is {i} times {i + 3}, "
                    "and why does it matter to anyone at all?",
                }
            ],
            max_tokens=8,
        )
    full = stats()
    assert full["skipped"] >= 4 and 0 < full["bytes"] <= budget
    assert turn(sea) >= 24  # its first turn outlived the flood

    hills = [
        {
            "role": "user",
            "content": "Describe the hills in winter, the snow on them "
            "and the people who walk there.",
        }
    ]
    skipped = stats()["skipped"]
    assert turn(hills) == 0 and stats()["skipped"] == skipped + 1  # turned away
    assert turn(hills) == 0  # shares its first turn's opening: taken in
    assert stats()["skipped"] == skipped + 1
    assert turn(hills) >= 24  # and served from the tier
    assert stats()["bytes"] <= budget
