"""An empty or blank model name is a 400 naming ``model`` on every route that takes one, in
the route's dialect, and changes nothing: it never silently means the default model (an
unload of ``""`` unloaded the default one). Leaving the field out still means the default
where the route allows it.

The routes are found in the OpenAPI document (every operation whose body has a ``model``
field), so a route added tomorrow is checked tomorrow; each needs a body below that is
valid but for its model.
"""

from __future__ import annotations

import httpx
import pytest

MSG = [{"role": "user", "content": "hi"}]

# a body each route accepts, but for the model name put into it
VALID: dict[str, dict] = {
    "/v1/chat/completions": {"messages": MSG, "max_tokens": 1},
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/v1/responses": {"input": "hi", "max_output_tokens": 1},
    "/v1/messages": {"messages": MSG, "max_tokens": 1},
    "/v1/messages/count_tokens": {"messages": MSG},
    "/v1/embeddings": {"input": "hi"},
    "/v1/rerank": {"query": "q", "documents": ["a"]},
    "/rerank": {"query": "q", "documents": ["a"]},
    "/v2/rerank": {"query": "q", "documents": ["a"]},
    "/v1/tokenize": {"input": "hi"},
    "/v1/audio/speech": {"input": "hi"},
    "/generate": {"prompt": "hi", "max_tokens": 1},
    "/unload": {},
    "/api/generate": {"prompt": "hi", "stream": False, "options": {"num_predict": 1}},
    "/api/chat": {"messages": MSG, "stream": False, "options": {"num_predict": 1}},
    "/api/embed": {"input": "hi"},
    "/api/embeddings": {"prompt": "hi"},
    "/api/show": {},
    "/api/pull": {"stream": False},
    "/api/delete": {},
}
FORMS = {"/v1/audio/transcriptions", "/v1/audio/translations"}


def _takes_model(spec: dict, op: dict) -> bool:
    for media in (op.get("requestBody") or {}).get("content", {}).values():
        top = media.get("schema") or {}
        for schema in [top, *top.get("anyOf", [])]:  # an optional body is anyOf [body, null]
            ref = schema.get("$ref")
            if ref:
                schema = spec["components"]["schemas"][ref.rsplit("/", 1)[1]]
            if "model" in schema.get("properties", {}):
                return True
    return False


def _model_routes(app) -> list[tuple[str, str]]:
    spec = app.openapi()
    return sorted(
        (method.upper(), path)
        for path, ops in spec["paths"].items()
        for method, op in ops.items()
        if _takes_model(spec, op)
    )


def _assert_refused(path: str, r: httpx.Response) -> None:
    assert r.status_code == 400, (path, r.status_code, r.text)
    body = r.json()
    if path.startswith("/api/"):
        assert set(body) == {"error"} and "model" in body["error"], (path, body)
    elif path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert "model" in body["error"]["message"], (path, body)
    else:
        assert body["error"]["param"] == "model", (path, body)
        assert body["error"]["type"] == "invalid_request_error"


def test_the_walk_finds_the_routes_that_take_a_model(server):
    routes = {p for _, p in _model_routes(server.app)}
    assert {"/unload", "/v1/chat/completions", "/api/embed", "/v1/audio/speech"} <= routes
    assert routes <= set(VALID) | FORMS, f"add a valid body for {routes - set(VALID) - FORMS}"


@pytest.mark.parametrize("name", ["", "   ", "\t\n"], ids=["empty", "blanks", "whitespace"])
def test_a_blank_model_name_is_a_400_on_every_route(server, name):
    with server.client() as c:
        before = sorted(m["name"] for m in c.get("/api/ps").json()["models"])
        assert before, "the fixture's models are loaded"
        for method, path in _model_routes(server.app):
            if path in FORMS:
                r = c.post(path, data={"model": name}, files={"file": ("a.wav", b"RIFF")})
            else:
                r = c.request(method, path, json={**VALID[path], "model": name})
            _assert_refused(path, r)
        # nothing was unloaded, pulled or deleted by any of them
        assert sorted(m["name"] for m in c.get("/api/ps").json()["models"]) == before
        assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_unload_of_an_empty_name_keeps_the_default_model_loaded(server):
    with server.client() as c:
        default = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).json()["model"]
        r = c.post("/unload", json={"model": ""})
        _assert_refused("/unload", r)
        assert "empty" in r.json()["error"]["message"]
        assert default in [m["name"] for m in c.get("/api/ps").json()["models"]]


def test_a_named_model_with_blanks_around_it_is_not_the_default(server):
    """Only a name that is nothing but blanks is refused here; " tiny-llama" is a name the
    store does not have, not the default model."""
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"model": " no-such ", "messages": MSG})
        assert r.status_code in (400, 404), r.text
        assert r.json()["error"]["param"] == "model"
