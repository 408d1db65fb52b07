"""``null`` means "the default" for every field OpenAI documents as nullable, in chat
completions, completions, embeddings and responses: the official ``openai`` client sends
nulls for parameters its caller passed as None. Wrong types are still a 400 naming the
field (tests/api/test_strict_types.py)."""

from __future__ import annotations

import openai
import pytest

MSG = [{"role": "user", "content": "hi"}]

# every field OpenAI's reference marks nullable on each endpoint, set to null
CHAT_NULLS = {
    "n": None,
    "stream": None,
    "logprobs": None,
    "top_logprobs": None,
    "temperature": None,
    "top_p": None,
    "max_completion_tokens": None,
    "stop": None,
    "seed": None,
    "presence_penalty": None,
    "frequency_penalty": None,
    "user": None,
    "stream_options": None,
    "response_format": None,
    "tools": None,
    "tool_choice": None,
    "parallel_tool_calls": None,
    "logit_bias": None,
    "store": None,
    "metadata": None,
    "modalities": None,
    "audio": None,
    "reasoning_effort": None,
    "service_tier": None,
    "prediction": None,
}
COMPLETION_NULLS = {
    "n": None,
    "stream": None,
    "logprobs": None,
    "temperature": None,
    "top_p": None,
    "stop": None,
    "seed": None,
    "presence_penalty": None,
    "frequency_penalty": None,
    "user": None,
    "stream_options": None,
    "logit_bias": None,
    "echo": None,
    "best_of": None,
    "suffix": None,
}
EMBEDDING_NULLS = {"encoding_format": None, "dimensions": None, "user": None}
RESPONSES_NULLS = {
    "instructions": None,
    "temperature": None,
    "top_p": None,
    "tools": None,
    "tool_choice": None,
    "parallel_tool_calls": None,
    "text": None,
    "stream": None,
    "store": None,
    "previous_response_id": None,
    "metadata": None,
    "user": None,
    "reasoning": None,
    "truncation": None,
    "include": None,
    "background": None,
    "service_tier": None,
    "top_logprobs": None,
    "max_tool_calls": None,
}


@pytest.mark.parametrize(
    ("path", "body", "nulls"),
    [
        ("/v1/chat/completions", {"messages": MSG, "max_tokens": 2}, CHAT_NULLS),
        (
            "/v1/chat/completions",
            {"messages": MSG, "max_completion_tokens": 2},
            {"max_tokens": None},
        ),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, COMPLETION_NULLS),
        ("/v1/embeddings", {"input": "hi"}, EMBEDDING_NULLS),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 2}, RESPONSES_NULLS),
    ],
    ids=["chat", "chat-max_tokens", "completions", "embeddings", "responses"],
)
def test_explicit_nulls_mean_the_defaults(server, path, body, nulls):
    with server.client() as c:
        plain = c.post(path, json=body)
        nulled = c.post(path, json={**body, **nulls})
    assert plain.status_code == 200, plain.text
    assert nulled.status_code == 200, nulled.text
    p, n = plain.json(), nulled.json()
    if path == "/v1/embeddings":
        assert n["data"][0]["embedding"] == p["data"][0]["embedding"]  # floats, full size
    elif path == "/v1/responses":
        assert n["status"] == p["status"] and n["store"] is True  # store's default
    else:
        assert len(n["choices"]) == 1 and n["usage"]["completion_tokens"] == 2
        if path == "/v1/chat/completions":
            assert n["choices"][0]["logprobs"] is None  # logprobs' default: off


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": MSG, "n": "1"}, "n"),
        ("/v1/chat/completions", {"messages": MSG, "stream": "false"}, "stream"),
        ("/v1/chat/completions", {"messages": MSG, "logprobs": 0}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "echo": 0}, "echo"),
        ("/v1/embeddings", {"input": "hi", "encoding_format": 1}, "encoding_format"),
        ("/v1/responses", {"input": "hi", "store": "yes"}, "store"),
        ("/v1/responses", {"input": "hi", "stream": 0}, "stream"),
        ("/v1/chat/completions", {"messages": MSG, "model": None}, "model"),
        ("/v1/chat/completions", {"messages": None}, "messages"),
    ],
)
def test_wrong_types_and_nulls_of_required_fields_are_still_400(server, path, body, param):
    with server.client() as c:
        r = c.post(path, json={"max_tokens": 1, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_the_openai_client_with_none_for_every_nullable_parameter(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    chat = client.chat.completions.create(
        model="tiny-llama",
        messages=MSG,
        max_tokens=2,
        n=None,
        stream=None,
        logprobs=None,
        top_logprobs=None,
        temperature=None,
        top_p=None,
        stop=None,
        seed=None,
        presence_penalty=None,
        frequency_penalty=None,
        user=None,
        stream_options=None,
        response_format=None,
        tools=None,
        tool_choice=None,
        parallel_tool_calls=None,
        logit_bias=None,
        store=None,
        metadata=None,
        max_completion_tokens=None,
    )
    assert chat.usage.completion_tokens == 2 and len(chat.choices) == 1
    done = client.completions.create(
        model="tiny-llama",
        prompt="hi",
        max_tokens=2,
        n=None,
        stream=None,
        logprobs=None,
        echo=None,
        best_of=None,
        suffix=None,
        temperature=None,
        top_p=None,
        stop=None,
        seed=None,
        user=None,
        logit_bias=None,
        presence_penalty=None,
        frequency_penalty=None,
        stream_options=None,
    )
    assert done.usage.completion_tokens == 2
    emb = client.embeddings.create(
        input="hi", model="all-minilm-l6-v2", encoding_format=None, dimensions=None, user=None
    )
    assert len(emb.data[0].embedding) == 384
    # the client's own default asks for base64 and decodes it: the same vector
    b64 = client.embeddings.create(input="hi", model="all-minilm-l6-v2")
    assert b64.data[0].embedding == pytest.approx(emb.data[0].embedding, abs=1e-6)
    resp = client.responses.create(
        model="tiny-llama",
        input="hi",
        max_output_tokens=2,
        stream=None,
        store=None,
        instructions=None,
        temperature=None,
        top_p=None,
        tools=None,
        tool_choice=None,
        parallel_tool_calls=None,
        previous_response_id=None,
        metadata=None,
        user=None,
        reasoning=None,
        text=None,
        truncation=None,
        include=None,
    )
    assert resp.status in ("completed", "incomplete") and resp.usage.output_tokens <= 2
    # a stored response (store's default: true) can be read back
    assert client.responses.retrieve(resp.id).id == resp.id
