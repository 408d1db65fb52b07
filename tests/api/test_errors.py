"""Bad input gets a clear OpenAI error object with a truthful status, and changes nothing."""

from __future__ import annotations

import httpx
import pytest

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def _assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        (CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
        (CHAT, {"messages": MSG, "max_tokens": "many"}, 400, "max_tokens"),
        (CHAT, {"messages": MSG, "temperature": -0.5}, 400, "temperature"),
        (CHAT, {"messages": MSG, "top_p": 1.5}, 400, "top_p"),
        (CHAT, {"messages": "hello"}, 400, "messages"),
        (CHAT, {"messages": []}, 400, "messages"),
        (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
        (CHAT, {"messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
        (CHAT, {"messages": MSG, "n": 0}, 400, "n"),
        (CHAT, {"messages": MSG, "n": 65}, 400, "n"),
        (CHAT, {"messages": MSG, "logit_bias": {"999999": 5}}, 400, "logit_bias"),
        (CHAT, {"messages": MSG, "logit_bias": {"abc": 5}}, 400, "logit_bias"),
        (CHAT, {"model": "no-such-model", "messages": MSG}, 404, "model"),
        (CHAT, {"model": "../../etc/passwd", "messages": MSG}, 400, "model"),
        (
            CHAT,
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image_url",
                                "image_url": {"url": "data:image/png;base64,AA=="},
                            }
                        ],
                    }
                ]
            },
            400,
            "messages[0].content",
        ),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
        ("/v1/completions", {"model": "missing", "prompt": "x"}, 404, "model"),
        ("/generate", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/generate", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/generate", {"max_tokens": 3}, 400, "prompt"),
    ],
)
def test_bad_input(server, path, body, status, param):
    with server.client() as c:
        _assert_openai_error(c.post(path, json=body), status, param)


def test_malformed_json_is_400(server):
    with server.client() as c:
        for path in (CHAT, "/v1/completions", "/generate"):
            r = c.post(
                path, content=b'{"messages": [', headers={"content-type": "application/json"}
            )
            err = _assert_openai_error(r, 400)
            assert "JSON" in err["message"]


def test_prompt_longer_than_context(server):
    long_prompt = "word " * 600  # the tiny model's context is 256 tokens
    with server.client() as c:
        err = _assert_openai_error(
            c.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 4}), 400, "prompt"
        )
        assert err["code"] == "context_length_exceeded"
        err = _assert_openai_error(
            c.post(CHAT, json={"messages": [{"role": "user", "content": long_prompt}]}),
            400,
            "messages",
        )
        assert err["code"] == "context_length_exceeded"
        err = _assert_openai_error(
            c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 10_000}),
            400,
            "max_tokens",
        )
        assert err["code"] == "context_length_exceeded"


def test_server_keeps_serving_after_errors(server):
    with server.client() as c:
        for _ in range(3):
            c.post(CHAT, json={"messages": MSG, "max_tokens": 0})
            c.post(CHAT, content=b"nope")
        r = c.post(CHAT, json={"messages": MSG, "max_tokens": 2})
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == 2
        assert server.health()["requests_in_flight"] == 0


def test_unknown_route_is_openai_shaped_404(server):
    with server.client() as c:
        _assert_openai_error(c.get("/v1/nothing-here"), 404)
