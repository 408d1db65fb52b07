"""JSON types are strict, as in every dialect's reference server: a bool is not a number, a
number is not a bool, a string is not a number. Each case is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"messages": MSG, "keep_alive": False}, "keep_alive"),
        (CHAT, {"messages": MSG, "top_k": False}, "top_k"),
        (CHAT, {"messages": MSG, "parallel_tool_calls": 0}, "parallel_tool_calls"),
        (CHAT, {"messages": MSG, "max_tokens": True}, "max_tokens"),
        (CHAT, {"messages": MSG, "max_tokens": 2.0}, "max_tokens"),
        (CHAT, {"messages": MSG, "temperature": "0.5"}, "temperature"),
        (CHAT, {"messages": MSG, "temperature": True}, "temperature"),
        (CHAT, {"messages": MSG, "stream": 1}, "stream"),
        (CHAT, {"messages": MSG, "logprobs": "true"}, "logprobs"),
        (CHAT, {"messages": MSG, "n": "2"}, "n"),
        (CHAT, {"messages": MSG, "seed": 1.5}, "seed"),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ("/v1/completions", {"prompt": [False]}, "prompt"),
        ("/v1/completions", {"prompt": [[1, True]]}, "prompt"),
        ("/v1/completions", {"prompt": [-1]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "echo": 0}, "echo"),
        ("/generate", {"prompt": "hi", "chat": "yes"}, "chat"),
        ("/v1/responses", {"input": "hi", "store": 0}, "store"),
        ("/v1/embeddings", {"input": "hi", "truncate": "false"}, "truncate"),
        ("/v1/tokenize", {"input": "hi", "return_tokens": 1}, "return_tokens"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": True}, "top_n"),
    ],
)
def test_openai_shaped_routes_are_strict(server, path, body, param):
    with server.client() as c:
        short = path in (CHAT, "/v1/completions")  # a body's own max_tokens wins
        r = c.post(path, json={"max_tokens": 1, **body} if short else body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("path", "extra", "word"),
    [
        ("/api/generate", {"keep_alive": False}, "keep_alive"),
        ("/api/generate", {"options": {"num_predict": -5}}, "num_predict"),
        ("/api/generate", {"options": {"top_k": False}}, "top_k"),
        ("/api/generate", {"options": {"num_predict": "4"}}, "num_predict"),
        ("/api/generate", {"options": {"temperature": "hot"}}, "temperature"),
        ("/api/generate", {"raw": 1}, "raw"),
        ("/api/chat", {"stream": "no"}, "stream"),
        ("/api/chat", {"think": 1}, "think"),
        ("/api/embed", {"truncate": 0}, "truncate"),
    ],
)
def test_ollama_routes_are_strict(server, path, extra, word):
    body = {"model": "tiny-llama", "stream": False, "options": {"num_predict": 1}}
    body.update(
        {"messages": MSG}
        if path == "/api/chat"
        else {"input": "hi"}
        if path == "/api/embed"
        else {"prompt": "hi"}
    )
    body.update(extra)
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"} and word in r.json()["error"]


def test_anthropic_is_strict(server):
    with server.client() as c:
        r = c.post("/v1/messages", json={"max_tokens": "5", "messages": MSG})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "max_tokens" in r.json()["error"]["message"]


def test_the_right_types_still_pass(server):
    """An integer fills a float field; keep_alive takes a duration string or seconds."""
    with server.client() as c:
        r = c.post(
            CHAT,
            json={
                "messages": MSG,
                "max_tokens": 1,
                "temperature": 1,
                "top_p": 1,
                "keep_alive": "5m",
                "parallel_tool_calls": False,
            },
        )
        assert r.status_code == 200, r.text
        r = c.post(
            "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1, "keep_alive": 300}
        )
        assert r.status_code == 200, r.text
    r = httpx.post(
        server.url + "/api/generate",
        timeout=60,
        json={
            "model": "tiny-llama",
            "prompt": "hi",
            "stream": False,
            "keep_alive": 60.5,
            "options": {"num_predict": 1, "temperature": 0, "top_k": 5},
        },
    )
    assert r.status_code == 200, r.text
