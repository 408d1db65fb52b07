"""POST /v1/messages and /v1/messages/count_tokens through the official anthropic client."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

GREEDY = {"temperature": 0}  # this client version sends sampling settings as extra_body
MSGS = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def claude(agent_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=agent_server.url, api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def oai(agent_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=agent_server.url + "/v1", api_key="x", max_retries=0)


def test_message_matches_chat_completions_and_streams_the_same(claude, oai):
    m = claude.messages.create(
        model="plain-llama", max_tokens=12, system="Be brief.", messages=MSGS, extra_body=GREEDY
    )
    assert m.type == "message" and m.role == "assistant" and m.model == "plain-llama"
    assert m.id.startswith("msg_") and m.stop_reason == "max_tokens"
    assert m.usage.output_tokens == 12
    (block,) = m.content
    ref = oai.chat.completions.create(
        model="plain-llama",
        max_tokens=12,
        temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, *MSGS],
    )
    assert block.type == "text" and block.text == ref.choices[0].message.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == ref.usage.prompt_tokens

    with claude.messages.stream(
        model="plain-llama", max_tokens=12, system="Be brief.", messages=MSGS, extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == block.text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    # the same prompt again: served from the prefix cache
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == ref.usage.prompt_tokens


def test_stream_event_order(agent_server):
    body = {"model": "plain-llama", "max_tokens": 5, "stream": True, "messages": MSGS}
    with httpx.stream("POST", agent_server.url + "/v1/messages", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = list(r.iter_lines())
    names = [ln[7:] for ln in lines if ln.startswith("event: ")]
    data = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]
    assert names == [d["type"] for d in data]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert data[0]["message"]["usage"]["input_tokens"] > 0
    assert data[1]["content_block"] == {"type": "text", "text": ""}
    assert all(d["delta"]["type"] == "text_delta" for d in data[3:-3])
    assert data[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert data[-2]["usage"]["output_tokens"] == 5


def test_stop_sequence(claude):
    full = (
        claude.messages.create(model="plain-llama", max_tokens=16, messages=MSGS, extra_body=GREEDY)
        .content[0]
        .text
    )
    stop = full[5:8]
    m = claude.messages.create(
        model="plain-llama",
        max_tokens=16,
        messages=MSGS,
        stop_sequences=[stop, "never-there"],
        extra_body=GREEDY,
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == full[: full.index(stop)]


def test_count_tokens(claude):
    kw = dict(
        model="tool-qwen2",
        system="Be brief.",
        messages=MSGS,
        tools=[{"name": "f", "input_schema": {"type": "object", "properties": {}}}],
    )
    n = claude.messages.count_tokens(**kw).input_tokens
    m = claude.messages.create(max_tokens=1, extra_body=GREEDY, **kw)
    assert n == m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert n > claude.messages.count_tokens(model="tool-qwen2", messages=MSGS).input_tokens


def test_errors_are_anthropic_shaped(agent_server, claude):
    def post(body):
        return httpx.post(agent_server.url + "/v1/messages", json=body, timeout=30)

    for body, status in (
        ({"model": "plain-llama", "messages": MSGS}, 400),  # max_tokens is required
        ({"model": "plain-llama", "max_tokens": 5, "messages": []}, 400),
        ({"model": "no-such-model", "max_tokens": 5, "messages": MSGS}, 404),
        (
            {
                "model": "plain-llama",
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": "image/png",
                                    "data": "iVBORw0KGgo=",
                                },
                            }
                        ],
                    }
                ],
            },
            400,
        ),
    ):
        r = post(body)
        assert r.status_code == status, r.text
        err = r.json()
        assert err["type"] == "error" and set(err["error"]) == {"type", "message"}
    assert "does not accept images" in r.json()["error"]["message"]
    r = httpx.post(
        agent_server.url + "/v1/messages",
        content=b"{",
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="no-such-model", max_tokens=5, messages=MSGS)
