"""Sampling parameters are checked at the edge: a bad one is a 400 naming it in the caller's
dialect, an accepted one can never fail inside the engine (where it would take down every
sequence decoding beside it), and nothing non-finite ever reaches the wire."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
INT64_MAX = 2**63 - 1


def _openai_400(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and param in err["message"]


def _ollama_400(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    body = r.json()
    assert set(body) == {"error"} and param in body["error"]


@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/generate"])
@pytest.mark.parametrize("seed", [-1, -(2**63), INT64_MAX])
def test_any_int64_seed_is_served(server, path, seed):
    body = {"max_tokens": 3, "temperature": 0.8, "seed": seed}
    body.update({"messages": MSG} if path == CHAT else {"prompt": "hi"})
    with server.client() as c:
        first, second = c.post(path, json=body), c.post(path, json=body)
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["completion_tokens"] == 3
    # a seed still pins the text, negative ones included
    assert first.json().get("choices", first.json().get("text")) == second.json().get(
        "choices", second.json().get("text")
    )


@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/generate"])
@pytest.mark.parametrize("seed", [2**63, 2**70, -(2**63) - 1])
def test_seed_outside_int64_is_400(server, path, seed):
    body = {"max_tokens": 2, "temperature": 0.8, "seed": seed}
    body.update({"messages": MSG} if path == CHAT else {"prompt": "hi"})
    with server.client() as c:
        _openai_400(c.post(path, json=body), "seed")


def test_n_choices_with_the_largest_seed(server):
    """Choice i samples with seed + i: past int64 it must still be a valid key."""
    with server.client() as c:
        r = c.post(
            CHAT,
            json={"messages": MSG, "max_tokens": 2, "temperature": 0.8, "seed": INT64_MAX, "n": 3},
        )
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3


@pytest.mark.parametrize("path", ["/api/generate", "/api/chat"])
def test_ollama_seed_minus_one_means_random(server, path):
    body = {
        "model": "tiny-llama",
        "stream": False,
        "options": {"seed": -1, "num_predict": 3, "temperature": 0.8},
    }
    body.update({"messages": MSG} if path == "/api/chat" else {"prompt": "hi"})
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["eval_count"] == 3
    body["options"]["seed"] = 2**64
    _ollama_400(httpx.post(server.url + path, json=body, timeout=60), "seed")


def test_a_negative_seed_leaves_concurrent_streams_alone(server):
    """The failure this guards against killed every stream decoding beside the bad row."""
    done: dict = {}

    def stream() -> None:
        events = []
        with httpx.stream(
            "POST",
            server.url + CHAT,
            timeout=60,
            json={"messages": MSG, "max_tokens": 24, "temperature": 0, "stream": True},
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
        done["events"] = events

    t = threading.Thread(target=stream)
    t.start()
    with server.client() as c:
        for seed in (-1, -5, -(2**63)):
            r = c.post(
                "/v1/completions",
                json={"prompt": "hi", "max_tokens": 4, "temperature": 0.9, "seed": seed},
            )
            assert r.status_code == 200, r.text
    t.join(60)
    events = done["events"]
    assert not any("error" in e for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("top_p", 0),
        ("top_p", 1.01),
        ("top_k", -2),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("repetition_penalty", 0),
        ("repetition_penalty", 1e-300),
        ("repetition_penalty", 1e6),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("n", 0),
        ("max_tokens", 0),
    ],
)
@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
def test_openai_ranges(server, path, field, value):
    body = {"max_tokens": 1, field: value}
    body.update({"messages": MSG} if path == CHAT else {"prompt": "hi"})
    with server.client() as c:
        _openai_400(c.post(path, json=body), field)


def test_logit_bias_values_must_be_finite_and_in_range(server):
    with server.client() as c:
        for raw in ('{"5": 101}', '{"5": NaN}', '{"5": -1e400}'):
            r = c.post(
                CHAT,
                content='{"messages": [{"role": "user", "content": "hi"}], '
                '"max_tokens": 1, "logit_bias": ' + raw + "}",
                headers={"content-type": "application/json"},
            )
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"].startswith("logit_bias")


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("temperature", -1),
        ("top_p", 0),
        ("top_k", -1),
        ("min_p", 2),
        ("repeat_penalty", 1e-300),
        ("presence_penalty", 3),
        ("frequency_penalty", -2.5),
        ("num_predict", -5),
        ("seed", -(2**63) - 1),
    ],
)
def test_ollama_option_ranges(server, option, value):
    r = httpx.post(
        server.url + "/api/generate",
        timeout=60,
        json={
            "model": "tiny-llama",
            "prompt": "hi",
            "stream": False,
            "options": {"num_predict": 1, option: value},
        },
    )
    _ollama_400(r, option)


@pytest.mark.parametrize("n", [-1, -2])
def test_ollama_num_predict_infinite_and_fill_context_are_served(server, n):
    r = httpx.post(
        server.url + "/api/generate",
        timeout=60,
        json={
            "model": "tiny-llama",
            "prompt": "hi",
            "stream": False,
            "options": {"num_predict": n, "temperature": 0, "stop": ["e"]},
        },
    )
    assert r.status_code == 200, r.text


def test_anthropic_and_responses_ranges(server):
    with server.client() as c:
        r = c.post("/v1/messages", json={"max_tokens": 1, "messages": MSG, "top_p": 0})
        assert r.status_code == 400 and r.json()["type"] == "error"
        assert "top_p" in r.json()["error"]["message"]
        r = c.post("/v1/responses", json={"input": "hi", "temperature": -1})
        _openai_400(r, "temperature")
