"""Nothing non-finite crosses the wire: NaN/Infinity in a request is a 400, a logprob of
-inf is reported as OpenAI's floor (-9999.0), and a vanishing temperature is greedy."""

from __future__ import annotations

import json

import httpx
import pytest

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def _openai_400(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and param in err["message"]


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400"])
@pytest.mark.parametrize(
    "field", ["temperature", "top_p", "repetition_penalty", "presence_penalty"]
)
def test_non_finite_numbers_are_400(server, field, literal):
    """Python's JSON parser takes NaN and Infinity literals, and 1e400 overflows to inf."""
    raw = '{"prompt": "hi", "max_tokens": 1, "' + field + '": ' + literal + "}"
    with server.client() as c:
        _openai_400(
            c.post("/v1/completions", content=raw, headers={"content-type": "application/json"}),
            field,
        )


def test_absurd_repetition_penalty_with_logprobs_is_400_not_500(server):
    with server.client() as c:
        r = c.post(
            "/v1/completions",
            json={"prompt": "hello", "max_tokens": 1, "logprobs": 1, "repetition_penalty": 1e-300},
        )
        _openai_400(r, "repetition_penalty")
        r = c.post(
            CHAT,
            json={"messages": MSG, "max_tokens": 1, "logprobs": True, "repetition_penalty": 1e-300},
        )
        _openai_400(r, "repetition_penalty")


def test_masked_tokens_have_a_finite_logprob(server):
    """Structured output masks all but '{' at the first step: the other top tokens have
    probability 0 (logprob -inf), which JSON cannot carry. OpenAI's floor is -9999."""
    body = {
        "messages": MSG,
        "max_tokens": 2,
        "logprobs": True,
        "top_logprobs": 5,
        "response_format": {"type": "json_object"},
    }
    with server.client() as c:
        r = c.post(CHAT, json=body)
        assert r.status_code == 200, r.text
        first = r.json()["choices"][0]["logprobs"]["content"][0]
        assert first["token"] == "{"
        assert [t["logprob"] for t in first["top_logprobs"]][1:] == [-9999.0] * 4
        with c.stream("POST", CHAT, json={**body, "stream": True}) as s:
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"

    def refuse(constant: str) -> None:
        pytest.fail(f"non-finite {constant} in a chunk")

    for ln in lines[:-1]:
        json.loads(ln[6:], parse_constant=refuse)
    assert any("-9999.0" in ln for ln in lines)


def test_tiny_temperature_is_greedy(server):
    """1/T overflows float32 for a tiny T: below 1e-5 the request is greedy, as in vLLM."""
    with server.client() as c:
        texts = {
            t: c.post(
                "/v1/completions",
                json={"prompt": "Once upon", "max_tokens": 12, "temperature": t, "seed": 3},
            ).json()["choices"][0]["text"]
            for t in (0, 1e-300, 1e-6)
        }
    assert texts[1e-300] == texts[0] == texts[1e-6]
