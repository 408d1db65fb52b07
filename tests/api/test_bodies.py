"""Every whole 200 body matches what /openapi.json documents for its route, field for field:
the routes build their bodies from api/bodies.py's models, the same models the document
publishes, whose schemas forbid undocumented fields."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

MSG = [{"role": "user", "content": "Say something"}]

CALLS: list[tuple[str, str, dict[str, Any] | None]] = [
    (
        "POST",
        "/v1/chat/completions",
        {
            "model": "tiny-llama",
            "messages": MSG,
            "max_tokens": 4,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ),
    ("POST", "/v1/chat/completions", {"model": "tiny-llama", "messages": MSG, "max_tokens": 2}),
    (
        "POST",
        "/v1/completions",
        {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 3, "logprobs": 2},
    ),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/tiny-llama", None),
    ("POST", "/generate", {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 3}),
    ("POST", "/v1/messages", {"model": "tiny-llama", "messages": MSG, "max_tokens": 3}),
    ("POST", "/v1/messages/count_tokens", {"model": "tiny-llama", "messages": MSG}),
    ("POST", "/v1/tokenize", {"model": "tiny-llama", "input": ["a b", "c"], "return_tokens": True}),
    (
        "POST",
        "/api/generate",
        {"model": "tiny-llama", "prompt": "Hi", "stream": False, "options": {"num_predict": 3}},
    ),
    (
        "POST",
        "/api/chat",
        {"model": "tiny-llama", "messages": MSG, "stream": False, "options": {"num_predict": 3}},
    ),
]


@pytest.fixture(scope="module")
def document(server) -> dict[str, Any]:
    with server.client() as c:
        return c.get("/openapi.json").json()


def _schema(document: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    templated = "/v1/models/{model_id}" if path.startswith("/v1/models/") else path
    op = document["paths"][templated][method.lower()]
    schema = op["responses"]["200"]["content"]["application/json"]["schema"]
    return {**schema, "components": document["components"]}


@pytest.mark.parametrize(("method", "path", "body"), CALLS, ids=[f"{m} {p}" for m, p, _ in CALLS])
def test_the_body_is_what_the_document_says(server, document, method, path, body):
    schema = _schema(document, method, path)
    with server.client() as c:
        r = c.request(method, path, json=body)
    assert r.status_code == 200, r.text
    jsonschema.Draft202012Validator(schema).validate(r.json())


def test_the_document_forbids_undocumented_fields(document):
    """What makes the check above strict: a field no model declares fails validation."""
    schema = _schema(document, "POST", "/v1/chat/completions")
    body = {
        "id": "x",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [],
        "usage": {"prompt_tokens": 1, "total_tokens": 1},
    }
    jsonschema.Draft202012Validator(schema).validate(body)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(schema).validate({**body, "undocumented": 1})
