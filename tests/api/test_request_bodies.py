"""Every JSON route reads its body one way: as JSON whatever the Content-Type (Ollama's and
TEI's documented curl calls send none, ``curl -d`` sends a form type), and a body nested
absurdly deep or carrying a lone surrogate is a 400 in the caller's dialect, never a 500."""

from __future__ import annotations

import httpx
import pytest

MSG = [{"role": "user", "content": "hi"}]
FORM = {"content-type": "application/x-www-form-urlencoded"}


def _json_routes(server) -> list[str]:
    """Every POST route the server documents with a JSON request body (the audio upload
    routes take multipart forms)."""
    spec = httpx.get(server.url + "/openapi.json").json()
    paths = [
        p
        for p, ops in spec["paths"].items()
        if "application/json" in ops.get("post", {}).get("requestBody", {}).get("content", {})
        and "{" not in p
    ]
    assert {"/v1/chat/completions", "/api/generate", "/v1/embeddings", "/generate"} <= set(paths)
    return paths


def _assert_dialect_400(r: httpx.Response, path: str, words: str) -> None:
    assert r.status_code == 400, (path, r.status_code, r.text[:300])
    body = r.json()
    if path.startswith("/api/"):
        assert set(body) == {"error"} and words in body["error"]
    elif path.startswith("/v1/messages"):
        assert body["type"] == "error" and words in body["error"]["message"]
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert words in body["error"]["message"]


@pytest.mark.parametrize("levels", [5_000, 10_000, 300])
def test_deep_nesting_is_400_on_every_json_route(server, levels):
    nested = "[" * levels + "]" * levels
    with server.client() as c:
        for path in _json_routes(server):
            for raw, headers in (
                (nested, {"content-type": "application/json"}),
                ('{"model": ' + nested + "}", FORM),
            ):
                _assert_dialect_400(
                    c.post(path, content=raw, headers=headers),
                    path,
                    "nests arrays and objects deeper than",
                )


def test_lone_surrogate_is_400_on_every_json_route(server):
    raw = (
        '{"model": "tiny-llama", "prompt": "a\\ud800b", "input": "a\\ud800b", '
        '"messages": [{"role": "user", "content": "a\\udfffb"}], "max_tokens": 1}'
    )
    with server.client() as c:
        for path in _json_routes(server):
            _assert_dialect_400(c.post(path, content=raw), path, "lone UTF-16 surrogate")
        # the same character as raw UTF-8 bytes, which Python's parser also decodes
        r = c.post("/v1/embeddings", content=b'{"input": "a\xed\xa0\x80b"}')
        _assert_dialect_400(r, "/v1/embeddings", "lone UTF-16 surrogate")


def test_a_surrogate_pair_is_text(server):
    raw = '{"messages": [{"role": "user", "content": "hi \\ud83d\\ude00"}], "max_tokens": 1}'
    with server.client() as c:
        r = c.post(
            "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
        )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("headers", [{}, FORM, {"content-type": "text/plain"}])
def test_any_content_type_is_read_as_json(server, headers):
    """Before, /v1/chat/completions, /api/generate and /api/chat answered 400 "Input should be
    a valid dictionary" to these while /generate and /v1/embeddings accepted them."""
    import json

    calls = {
        "/v1/chat/completions": {"messages": MSG, "max_tokens": 2},
        "/v1/completions": {"prompt": "hi", "max_tokens": 2},
        "/api/generate": {
            "model": "tiny-llama",
            "prompt": "hi",
            "stream": False,
            "options": {"num_predict": 2},
        },
        "/api/chat": {
            "model": "tiny-llama",
            "messages": MSG,
            "stream": False,
            "options": {"num_predict": 2},
        },
        "/generate": {"prompt": "hi", "max_tokens": 2},
        "/v1/messages": {"max_tokens": 2, "messages": MSG},
        "/v1/responses": {"input": "hi", "max_output_tokens": 2},
        "/v1/tokenize": {"model": "tiny-llama", "input": "hello world"},
        "/api/show": {"model": "tiny-llama"},
    }
    with server.client() as c:
        for path, body in calls.items():
            r = c.post(path, content=json.dumps(body).encode(), headers=headers)
            assert r.status_code == 200, (path, r.text[:300])


def test_malformed_json_without_content_type_is_400_in_dialect(server):
    with server.client() as c:
        for path in ("/v1/chat/completions", "/api/chat", "/v1/messages", "/v1/embeddings"):
            _assert_dialect_400(
                c.post(path, content=b'{"messages": [', headers=FORM), path, "not valid JSON"
            )


def test_server_keeps_serving_after_bad_bodies(server):
    with server.client() as c:
        c.post("/v1/chat/completions", content="[" * 20_000)
        r = c.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
