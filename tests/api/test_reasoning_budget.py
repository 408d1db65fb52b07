"""Reasoning budgets: when a thinking model's reasoning reaches the request's budget, the
server closes the thinking part and the answer follows; usage counts reasoning tokens.

The tiny models (tests/fixtures/thinking_models.py) never write ``</think>`` themselves,
so every reply that has an answer got it because the budget closed the part.
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
def r1_model(tmp_path_factory):
    from fixtures.thinking_models import make_tiny_r1_model

    return make_tiny_r1_model(tmp_path_factory.mktemp("m") / "tiny-r1", seed=4)


@pytest.fixture(scope="module")
def srv(tmp_path_factory, thinking_qwen3, r1_model) -> Iterator[LiveServer]:
    s = make_settings(
        tmp_path_factory.mktemp("home"),
        thinking_qwen3,
        models={"preload": [str(r1_model)]},
        engine={"reasoning_effort_budgets": {"minimal": 3, "low": 2}},
    )
    server = LiveServer(s).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


def _chat(client, model: str = MODEL, **extra):
    return client.chat.completions.create(
        model=model, messages=ASK, max_tokens=24, temperature=0, extra_body=extra
    )


def _reasoning(msg) -> str:
    return (msg.model_extra or {}).get("reasoning_content") or ""


def test_a_budget_closes_the_thinking_part_and_the_answer_follows(client):
    r = _chat(client, thinking_token_budget=5)
    msg = r.choices[0].message
    assert _reasoning(msg).strip() and msg.content and msg.content.strip(), msg
    assert "</think>" not in msg.content
    assert r.usage.completion_tokens == 24
    assert r.usage.completion_tokens_details.reasoning_tokens == 5

    # streamed: the reasoning deltas, then the answer's
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"thinking_token_budget": 5},
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    kinds = ["r" if _reasoning(d) else "c" for d in deltas if _reasoning(d) or d.content]
    assert kinds and kinds[0] == "r" and kinds[-1] == "c"
    assert kinds == sorted(kinds, key=lambda k: k == "c"), kinds  # never back to reasoning
    assert "".join(d.content or "" for d in deltas) == msg.content
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 5


def test_a_budget_of_zero_answers_at_once(client):
    r = _chat(client, thinking_token_budget=0)
    assert r.choices[0].message.content.strip()
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_without_a_budget_the_model_thinks_on_and_usage_says_so(client):
    r = _chat(client)
    assert not r.choices[0].message.content
    assert r.usage.completion_tokens_details.reasoning_tokens == 24


def test_reasoning_effort_names_a_budget_from_the_settings(client):
    r = _chat(client, reasoning_effort="minimal")  # engine.reasoning_effort_budgets: 3
    assert r.usage.completion_tokens_details.reasoning_tokens == 3
    assert r.choices[0].message.content.strip()
    r = _chat(client, reasoning_effort="none")  # the template closes the part itself
    assert r.usage.completion_tokens_details.reasoning_tokens == 0
    assert not _reasoning(r.choices[0].message)
    r = _chat(client, reasoning_effort="low", thinking_token_budget=6)  # the budget wins
    assert r.usage.completion_tokens_details.reasoning_tokens == 6


def test_a_model_without_thinking_reports_no_reasoning_tokens(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=4,
        extra_body={"thinking_token_budget": 2, "chat_template_kwargs": {"enable_thinking": False}},
    )
    # the template closed the part: still a thinking model, none of it reasoning
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_deepseek_r1_template(client):
    r = _chat(client, model="tiny-r1", thinking_token_budget=4)
    msg = r.choices[0].message
    assert _reasoning(msg).strip() and msg.content.strip(), msg
    assert r.usage.completion_tokens_details.reasoning_tokens == 4


def test_the_budget_closes_thinking_before_a_grammar_applies(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=48,
        temperature=0,
        response_format={"type": "json_object"},
        extra_body={"thinking_token_budget": 3},
    )
    msg = r.choices[0].message
    assert r.usage.completion_tokens_details.reasoning_tokens == 3
    assert msg.content.lstrip().startswith("{"), msg


@pytest.mark.parametrize(
    ("field", "value"),
    [("thinking_token_budget", -1), ("thinking_token_budget", "many"), ("reasoning_effort", "max")],
)
def test_bad_budgets_are_400(srv, field, value):
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": ASK, "max_tokens": 2, field: value},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_anthropic_budget_tokens(srv):
    claude = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
    m = claude.messages.create(
        model=MODEL,
        messages=ASK,
        max_tokens=16,
        thinking={"type": "enabled", "budget_tokens": 4},
    )
    kinds = [b.type for b in m.content]
    assert kinds == ["thinking", "text"], m.content
    assert m.content[0].thinking.strip() and m.content[1].text.strip()
    r = httpx.post(
        srv.url + "/v1/messages",
        json={
            "model": MODEL,
            "messages": ASK,
            "max_tokens": 4,
            "thinking": {"type": "enabled", "budget_tokens": -3},
        },
    )
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert "budget_tokens" in r.json()["error"]["message"]


def test_ollama_think_levels(srv):
    def chat(think) -> httpx.Response:
        return httpx.post(
            srv.url + "/api/chat",
            timeout=60,
            json={
                "model": MODEL,
                "messages": ASK,
                "stream": False,
                "think": think,
                "options": {"num_predict": 16, "temperature": 0},
            },
        )

    msg = chat("low").json()["message"]  # engine.reasoning_effort_budgets.low: 2
    assert msg["thinking"].strip() and msg["content"].strip(), msg
    r = chat("extreme")
    assert r.status_code == 400 and "error" in r.json(), r.text


def test_responses_reasoning_effort(client):
    r = client.responses.create(
        model=MODEL,
        input="Why is the sky blue?",
        max_output_tokens=16,
        reasoning={"effort": "minimal"},
    )
    # minimal turns thinking off in the template, as OpenAI's does for its own models
    assert r.output_text.strip()
    bad = httpx.post(
        str(client.base_url) + "responses",
        json={"model": MODEL, "input": "x", "reasoning": {"effort": "max"}},
    )
    assert bad.status_code == 400, bad.text
