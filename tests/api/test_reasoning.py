"""Reasoning split from the answer, for a model whose template opens a thinking part.

The model (tests/fixtures/thinking_models.py) is a tiny Qwen3 with ``<think>``/``</think>``
in its vocabulary; nothing in mlxd is configured for it. Its random weights never write
``</think>``, so with thinking on the whole reply is reasoning; ``enable_thinking: false``
makes the template close the part and the whole reply is answer.
"""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from conftest import LiveServer, make_settings

MODEL = "thinking-qwen3"
ASK = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def think_server(tmp_path_factory, thinking_qwen3) -> Iterator[LiveServer]:
    srv = LiveServer(make_settings(tmp_path_factory.mktemp("think-home"), thinking_qwen3)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(think_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=think_server.url + "/v1", api_key="x", max_retries=0)


def test_reasoning_content_through_the_openai_client(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24, temperature=0)
    msg = r.choices[0].message
    reasoning = msg.model_extra.get("reasoning_content")
    assert reasoning and reasoning.strip(), msg
    assert not msg.content  # never closed: nothing of it is answer
    assert "<think>" not in reasoning and "</think>" not in reasoning
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 24

    # streamed: reasoning_content deltas, several of them, adding up to the same text
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=24, temperature=0, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    parts = [d.model_extra.get("reasoning_content") for d in deltas]
    parts = [p for p in parts if p]
    assert len(parts) >= 3, deltas
    assert "".join(parts) == reasoning
    assert "".join(d.content or "" for d in deltas) == ""


def test_thinking_off_gives_an_answer_and_no_reasoning(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=24,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    msg = r.choices[0].message
    assert msg.content and msg.content.strip(), msg
    assert "reasoning_content" not in (msg.model_extra or {})


def test_thinking_in_the_anthropic_and_ollama_dialects(think_server):
    claude = anthropic.Anthropic(base_url=think_server.url, api_key="x", max_retries=0)
    m = claude.messages.create(
        model=MODEL,
        messages=ASK,
        max_tokens=16,
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert m.content[0].type == "thinking" and m.content[0].thinking.strip(), m.content
    assert "".join(b.text for b in m.content if b.type == "text") == ""
    m = claude.messages.create(
        model=MODEL, messages=ASK, max_tokens=16, thinking={"type": "disabled"}
    )
    assert [b.type for b in m.content] == ["text"] and m.content[0].text.strip(), m.content

    def ollama(think: bool) -> dict:
        r = httpx.post(
            think_server.url + "/api/chat",
            timeout=60,
            json={
                "model": MODEL,
                "messages": ASK,
                "stream": False,
                "think": think,
                "options": {"num_predict": 16, "temperature": 0},
            },
        )
        assert r.status_code == 200, r.text
        return r.json()["message"]

    msg = ollama(True)
    assert msg["thinking"].strip() and msg["content"] == ""
    msg = ollama(False)
    assert "thinking" not in msg and msg["content"].strip()
