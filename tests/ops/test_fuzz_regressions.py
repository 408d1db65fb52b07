"""Requests the fuzz (tests/ops/test_fuzz.py) once answered with a 5xx, each pinned here.

Integers beyond 64 bits: the front end handed them to the engine core's wire, whose
encoder (msgspec) raised ``OverflowError`` -> 500 (and a reset keep-alive connection). Every
dialect now answers 400 naming the field (api/wire.py ``WireModel``).
"""

from __future__ import annotations

import httpx
import pytest

BIG = 10**30  # any JSON integer beyond 2**63 - 1
MSGS = [{"role": "user", "content": "hi"}]

CASES = [
    ("/v1/embeddings", {"model": "tiny-llama", "input": [BIG]}, "input"),
    ("/v1/embeddings", {"model": "tiny-llama", "input": "x", "dimensions": BIG}, "dimensions"),
    (
        "/v1/completions",
        {"model": "tiny-llama", "prompt": "x", "max_tokens": 1, "top_k": BIG},
        "top_k",
    ),
    ("/v1/completions", {"model": "tiny-llama", "prompt": [[1, BIG]], "max_tokens": 1}, "prompt"),
    (
        "/v1/chat/completions",
        {"model": "tiny-llama", "messages": MSGS, "max_tokens": 1, "keep_alive": BIG},
        "keep_alive",
    ),
    ("/generate", {"model": "tiny-llama", "prompt": "x", "max_tokens": 1, "top_k": BIG}, "top_k"),
    (
        "/api/chat",
        {
            "model": "tiny-llama",
            "messages": MSGS,
            "stream": False,
            "options": {"num_predict": 1, "top_k": BIG},
        },
        "options.top_k",
    ),
    (
        "/api/generate",
        {"model": "tiny-llama", "prompt": "x", "stream": False, "keep_alive": BIG},
        "keep_alive",
    ),
    ("/api/embed", {"model": "tiny-llama", "input": "x", "dimensions": BIG}, "dimensions"),
    ("/api/embed", {"model": "tiny-llama", "input": "x", "options": {"num_ctx": BIG}}, "options"),
    (
        "/v1/messages",
        {"model": "tiny-llama", "messages": MSGS, "max_tokens": 1, "top_k": BIG},
        "top_k",
    ),
    (
        "/v1/rerank",
        {"model": "tiny-llama", "query": "q", "documents": ["a"], "top_n": BIG},
        "top_n",
    ),
    # an unknown field of a chat message travels to the template (and over the wire)
    (
        "/v1/tokenize",
        {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi", "extra": [1, BIG]}]},
        "messages[0]",
    ),
    (
        "/v1/chat/completions",
        {
            "model": "tiny-llama",
            "max_tokens": 1,
            "messages": [{"role": "user", "content": "hi", "extra": {"x": BIG}}],
        },
        "messages[0]",
    ),
]


@pytest.mark.parametrize(("path", "body", "field"), CASES, ids=[f"{p}:{f}" for p, _, f in CASES])
def test_an_integer_beyond_64_bits_is_a_400_naming_the_field(server, path, body, field):
    with server.client() as c:
        r = c.post(path, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        message = err if isinstance(err, str) else err["message"]
        assert message.startswith(f"{field}: ") and "64-bit" in message, message
        if path.startswith("/v1/messages"):
            assert r.json()["type"] == "error"  # Anthropic's shape
        # the connection stays usable (a 500 from an unhandled error closed it)
        assert c.get("/v1/models").status_code == 200


def test_the_64_bit_edges_themselves_still_pass_validation(server):
    """2**63 - 1 is a valid seed (OpenAI's signed 64-bit); the check must not eat it."""
    with server.client() as c:
        r = c.post(
            "/v1/chat/completions",
            json={"model": "tiny-llama", "messages": MSGS, "max_tokens": 1, "seed": 2**63 - 1},
        )
        assert r.status_code == 200, r.text
        r = c.post(
            "/v1/chat/completions",
            json={"model": "tiny-llama", "messages": MSGS, "max_tokens": 1, "seed": 2**63},
        )
        assert r.status_code == 400 and "seed" in r.json()["error"]["message"]


@pytest.mark.parametrize("keep_alive", [1e300, "99999999999999h", 2**62])
def test_api_ps_after_a_keep_alive_beyond_the_calendar(start_server, tiny_llama, keep_alive):
    """A keep_alive whose expiry lies past year 9999 made every later GET /api/ps a 500
    (datetime OverflowError); Ollama shows such models as expiring in year 9999."""
    srv = start_server(tiny_llama)
    with srv.client() as c:
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": "tiny-llama",
                "messages": MSGS,
                "max_tokens": 1,
                "keep_alive": keep_alive,
            },
        )
        assert r.status_code == 200, r.text
        ps = c.get("/api/ps")
        assert ps.status_code == 200, ps.text
        (entry,) = [m for m in ps.json()["models"] if m["name"] == "tiny-llama"]
        assert entry["expires_at"].startswith("9999-12-31T23:59:59")


def test_sse_is_documented_event_by_event(server):
    """Tools that read OpenAPI 3.1 (schemathesis among them) parse a text/event-stream into
    events {data, event, id, retry} and validate each against the schema: documented as a
    plain string, every streamed 200 "violated" its own documentation."""
    spec = server.client().get("/openapi.json").json()
    streams = [
        (path, op["responses"]["200"]["content"]["text/event-stream"]["schema"])
        for path, ops in spec["paths"].items()
        for op in ops.values()
        if "text/event-stream" in op["responses"].get("200", {}).get("content", {})
    ]
    assert {p for p, _ in streams} >= {"/v1/chat/completions", "/v1/messages", "/generate"}
    for path, schema in streams:
        assert schema["type"] == "object", path
        assert schema["properties"]["data"]["type"] == "string", path
        assert schema["properties"]["event"]["type"] == "string", path


def test_rerank_with_a_chat_model_that_cannot_score_is_a_400(start_server, tiny_llama):
    """Found by the fuzz: the tiny chat model's tokenizer has no single-token yes/no, so it
    cannot be an LLM reranker; that is the caller's choice of model (400), not a 500."""
    srv = start_server(tiny_llama)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = httpx.post(
            srv.url + path,
            json={"model": "tiny-llama", "query": "q", "documents": ["a", "b"]},
            timeout=30,
        )
        assert r.status_code == 400, (path, r.text)
        assert "cannot be used as a reranker" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "model"
