"""Clients written for mlx-vlm's server call the OpenAI routes without ``/v1``
(``/chat/completions``, ``/responses``, ``/models``): the same handlers answer them."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture()
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="x", max_retries=0)


def test_chat_completions_without_v1(client, server):
    msgs = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(
        model="tiny-llama", messages=msgs, max_tokens=3, temperature=0
    )
    assert r.choices[0].message.content and r.usage.completion_tokens == 3
    v1 = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    same = v1.chat.completions.create(
        model="tiny-llama", messages=msgs, max_tokens=3, temperature=0
    )
    assert same.choices[0].message.content == r.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model="tiny-llama", messages=msgs, max_tokens=3, temperature=0, stream=True
        )
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == r.choices[0].message.content
    )


def test_models_without_v1(client):
    ids = [m.id for m in client.models.list().data]
    assert "tiny-llama" in ids
    assert client.models.retrieve("tiny-llama").id == "tiny-llama"
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("no-such-model")
    assert exc.value.body["code"] == "model_not_found"


def test_responses_without_v1(client):
    r = client.responses.create(model="tiny-llama", input="hi", max_output_tokens=3, temperature=0)
    assert r.status in ("completed", "incomplete") and r.output_text
    assert client.responses.retrieve(r.id).id == r.id
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_errors_keep_the_openai_shape(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny-llama", messages=[], max_tokens=1)
    assert exc.value.body["param"] == "messages"
