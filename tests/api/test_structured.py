"""Structured output: the grammar engine makes even random weights write valid JSON."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@example\\.com$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "score": {"type": ["number", "null"]},
    },
    "required": ["name", "age", "email", "role", "address"],
    "additionalProperties": False,
}
RF = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
MSG = [{"role": "user", "content": "Invent a person."}]


@pytest.fixture(scope="module")
def client(agent_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=agent_server.url + "/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize("model", ["tool-qwen2", "plain-llama"])
def test_json_schema_output_validates_for_every_seed(client, model):
    def one(seed: int):
        return client.chat.completions.create(
            model=model,
            messages=MSG,
            response_format=RF,
            temperature=1.0,
            seed=seed,
            max_tokens=400,
        )

    with ThreadPoolExecutor(16) as pool:  # concurrent: constrained rows share the batch
        results = list(pool.map(one, range(16)))
    texts = set()
    for r in results:
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        doc = json.loads(choice.message.content)
        jsonschema.validate(doc, PERSON)
        texts.add(choice.message.content)
    assert len(texts) > 8  # sampled, not one forced answer


def test_json_object_and_streaming(client):
    for seed in range(4):
        r = client.chat.completions.create(
            model="tool-qwen2",
            messages=MSG,
            response_format={"type": "json_object"},
            temperature=0.7,
            seed=seed,
            max_tokens=600,
            logit_bias={},
        )
        assert r.choices[0].finish_reason in ("stop", "length")
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:  # a free-form object from random weights can run long: it is a prefix
            assert r.choices[0].message.content.startswith("{")
    chunks = list(
        client.chat.completions.create(
            model="tool-qwen2",
            messages=MSG,
            response_format=RF,
            temperature=0,
            max_tokens=400,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_unsupported_or_invalid_schema_is_400(client, agent_server):
    for schema in (
        {"type": "array", "uniqueItems": True},
        {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
        {"type": "nonsense"},
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="tool-qwen2",
                messages=MSG,
                max_tokens=5,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": schema},
                },
            )
        assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="tool-qwen2", messages=MSG, response_format={"type": "yaml"}
        )
    # streaming too: the 400 comes before any event
    r = httpx.post(
        agent_server.url + "/v1/chat/completions",
        json={
            "model": "tool-qwen2",
            "messages": MSG,
            "stream": True,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
            },
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


@pytest.mark.parametrize("stream", [False, True])
def test_lark_grammars_with_tokens_the_vocabulary_lacks_are_400(agent_server, stream):
    """Front ends validate grammars without a tokenizer (text/structured.py); what only
    the vocabulary can refute is refuted by the engine core, still as a 400 before any
    output, and a grammar naming a token the vocabulary has is served."""
    url = agent_server.url + "/v1/chat/completions"
    for grammar in ('start: "a" <[999999]>', 'start: "a" <|no_such_token|>'):
        r = httpx.post(
            url,
            json={
                "model": "tool-qwen2",
                "messages": MSG,
                "stream": stream,
                "max_tokens": 5,
                "response_format": {"type": "lark", "grammar": grammar},
            },
            timeout=60,
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and "token" in err["message"].lower()
        assert err["param"] == "response_format"
    r = httpx.post(
        url,
        json={
            "model": "tool-qwen2",
            "messages": MSG,
            "max_tokens": 5,
            "response_format": {"type": "lark", "grammar": 'start: "ok" <|im_end|>'},
        },
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"


def test_ollama_format_json_and_schema(agent_server):
    c = ollama.Client(host=agent_server.url)
    r = c.chat(
        model="tool-qwen2",
        messages=MSG,
        format=PERSON,
        options={"temperature": 1.0, "seed": 3, "num_predict": 400},
    )
    jsonschema.validate(json.loads(r.message.content), PERSON)
    r = c.generate(
        model="plain-llama",
        prompt="A person:",
        format=PERSON,
        options={"temperature": 0, "num_predict": 400},
    )
    jsonschema.validate(json.loads(r.response), PERSON)
    r = c.chat(
        model="tool-qwen2",
        messages=MSG,
        format="json",
        options={"temperature": 0, "num_predict": 600},
    )
    assert r.message.content.startswith("{")
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model="tool-qwen2", messages=MSG, format={"type": "array", "uniqueItems": True})
    assert e.value.status_code == 400
    r = httpx.post(
        agent_server.url + "/api/chat",
        json={"model": "tool-qwen2", "messages": MSG, "format": "yaml", "stream": False},
    )
    assert r.status_code == 400 and "format" in r.json()["error"]


def test_responses_and_anthropic_structured_output(agent_server, client):
    r = client.responses.create(
        model="tool-qwen2",
        input="Invent a person.",
        max_output_tokens=400,
        temperature=0,
        text={
            "format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
        },
    )
    jsonschema.validate(json.loads(r.output_text), PERSON)
    claude = anthropic.Anthropic(base_url=agent_server.url, api_key="x", max_retries=0)
    m = claude.messages.create(
        model="plain-llama",
        max_tokens=400,
        messages=MSG,
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": PERSON}}},
    )
    jsonschema.validate(json.loads(m.content[0].text), PERSON)


# {"$ref": "#"}: llguidance accepts it, but no production of it ever ends
ENDLESS = {"$ref": "#"}
# a pattern whose lexer outgrows llguidance's limits once its string starts
EXPLODING = {
    "type": "object",
    "properties": {"a": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
    "required": ["a"],
    "additionalProperties": False,
}


def _rf(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_that_cannot_start_is_400_in_every_dialect(agent_server, stream):
    """The core computes a grammar's first mask when it admits the request: a schema the
    grammar engine cannot serve is a 400 before any output, never an empty "stop"."""
    url = agent_server.url
    bodies = [
        (
            "/v1/chat/completions",
            {"model": "tool-qwen2", "messages": MSG, "response_format": _rf(ENDLESS)},
            "response_format",
        ),
        (
            "/v1/responses",
            {
                "model": "tool-qwen2",
                "input": "Invent a person.",
                "text": {"format": {"type": "json_schema", "name": "x", "schema": ENDLESS}},
            },
            None,
        ),
        (
            "/v1/chat/completions",
            {
                "model": "tool-qwen2",
                "messages": MSG,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": ENDLESS}}],
                "tool_choice": "required",
            },
            "tools",
        ),
    ]
    for path, body, param in bodies:
        r = httpx.post(url + path, json={**body, "max_tokens": 20, "stream": stream}, timeout=60)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert "not supported" in err["message"]
        if param is not None:
            assert err["param"] == param
    for path, body in (("/api/chat", {"messages": MSG}), ("/api/generate", {"prompt": "A"})):
        r = httpx.post(
            url + path,
            json={"model": "tool-qwen2", "format": ENDLESS, "stream": stream, **body},
            timeout=60,
        )
        assert r.status_code == 400 and "not supported" in r.json()["error"]
    r = httpx.post(
        url + "/v1/messages",
        json={
            "model": "tool-qwen2",
            "max_tokens": 20,
            "messages": MSG,
            "stream": stream,
            "output_config": {"format": {"type": "json_schema", "schema": ENDLESS}},
        },
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_a_grammar_that_fails_while_generating_is_an_error_not_a_stop(agent_server, client):
    """A matcher that fails mid-way (a resource limit) ends its row with an error the
    client sees: a 400 without a body, an error event then the end in a stream; never a
    truncated document with finish_reason "stop"."""
    url = agent_server.url
    kw = {"max_tokens": 60, "temperature": 0}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tool-qwen2", messages=MSG, response_format=_rf(EXPLODING), **kw
        )
    assert e.value.body["code"] == "grammar_error"
    r = httpx.post(
        url + "/v1/chat/completions",
        json={
            "model": "tool-qwen2",
            "messages": MSG,
            "response_format": _rf(EXPLODING),
            "stream": True,
            **kw,
        },
        timeout=60,
    )
    assert r.status_code == 200
    events = [
        json.loads(line[6:])
        for line in r.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    assert events[-1]["error"]["code"] == "grammar_error"
    assert r.text.rstrip().endswith("data: [DONE]")
    assert all(c["choices"][0]["finish_reason"] is None for c in events[:-1] if c.get("choices"))
    # the other dialects and a forced tool call whose arguments hold the pattern
    r = httpx.post(
        url + "/api/generate",
        json={
            "model": "tool-qwen2",
            "prompt": "A person:",
            "format": EXPLODING,
            "stream": True,
            "options": {"num_predict": 60, "temperature": 0},
        },
        timeout=60,
    )
    lines = [json.loads(line) for line in r.text.splitlines() if line]
    assert "grammar" in lines[-1]["error"] and not any(x.get("done") for x in lines)
    r = httpx.post(
        url + "/v1/responses",
        json={
            "model": "tool-qwen2",
            "input": "Invent a person.",
            "max_output_tokens": 60,
            "temperature": 0,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": EXPLODING}},
        },
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "grammar_error"
    r = httpx.post(
        url + "/api/chat",
        json={
            "model": "tool-qwen2",
            "messages": MSG,
            "format": EXPLODING,
            "stream": False,
            "options": {"num_predict": 60, "temperature": 0},
        },
        timeout=60,
    )
    assert r.status_code == 400 and "grammar" in r.json()["error"]
    r = httpx.post(
        url + "/v1/messages",
        json={
            "model": "tool-qwen2",
            "max_tokens": 60,
            "temperature": 0,
            "messages": MSG,
            "output_config": {"format": {"type": "json_schema", "schema": EXPLODING}},
        },
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(
        url + "/v1/chat/completions",
        json={
            "model": "tool-qwen2",
            "messages": MSG,
            "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": EXPLODING}}],
            **kw,
        },
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "grammar_error"
    # the server goes on serving constrained requests
    r = client.chat.completions.create(
        model="tool-qwen2", messages=MSG, response_format=RF, max_tokens=400, temperature=0
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
