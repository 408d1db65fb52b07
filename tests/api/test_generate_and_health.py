"""The simple /generate dialect, /health, and the request id."""

from __future__ import annotations

import json

import httpx
from fixtures.tiny_models import make_tiny_chat_model

from mlxd import __version__


def test_generate_returns_text(server):
    with server.client() as c:
        r = c.post("/generate", json={"prompt": "Once upon", "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    assert body["text"] and body["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    assert body["model"] == "tiny-llama"


def test_generate_accepts_json_without_content_type(server):
    # curl -d sends application/x-www-form-urlencoded; the simple dialect still reads JSON
    r = httpx.post(
        server.url + "/generate",
        content=b'{"prompt": "hi", "max_tokens": 2}',
        headers={"content-type": "application/x-www-form-urlencoded"},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_generate_streams_sse_token_by_token(server):
    body = {"prompt": "Once upon", "max_tokens": 5, "temperature": 0, "top_p": 1.0}
    full = httpx.post(server.url + "/generate", json=body).json()["text"]
    events = []
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    texts = [p["text"] for p in payloads if p["text"]]
    assert len(texts) >= 2  # token by token, not one blob
    assert "".join(texts) == full
    assert payloads[-1]["finish_reason"] == "length"


def _prompt_tokens(srv, **body) -> int:
    r = httpx.post(
        srv.url + "/generate",
        timeout=60,
        json={"prompt": "hi", "max_tokens": 1, "temperature": 0, **body},
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_generate_applies_the_chat_template_unless_raw(server):
    templated = _prompt_tokens(server)
    assert _prompt_tokens(server, chat=True) == templated
    assert _prompt_tokens(server, raw=True) < templated
    assert _prompt_tokens(server, chat=False) == _prompt_tokens(server, raw=True)
    r = httpx.post(server.url + "/generate", json={"prompt": "hi", "raw": True, "chat": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "raw"


def test_generate_sends_the_prompt_raw_to_a_model_without_template(start_server, tmp_path):
    path = make_tiny_chat_model(tmp_path / "base-llama", "llama", seed=2)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    srv = start_server(path)
    assert _prompt_tokens(srv) == _prompt_tokens(srv, raw=True)
    r = httpx.post(srv.url + "/generate", json={"prompt": "hi", "max_tokens": 1, "chat": True})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


def test_health_lists_loaded_models(server):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200
    h = r.json()
    assert h["status"] == "ok" and h["model_loaded"] is True
    names = {m["name"] for m in h["models"]}
    assert {"tiny-llama", "tiny-qwen2"} <= names


def test_health_and_the_ollama_version_name_the_package_version(server):
    assert httpx.get(server.url + "/health").json()["version"] == __version__
    assert httpx.get(server.url + "/api/version").json()["mlxd_version"] == __version__


def test_request_id_round_trips(server):
    r = httpx.get(server.url + "/health", headers={"X-Request-ID": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    r = httpx.get(server.url + "/health")
    assert len(r.headers["x-request-id"]) >= 16


def test_health_is_503_while_the_engine_core_is_down(start_server, tiny_llama):
    srv = start_server(tiny_llama)
    assert httpx.get(srv.url + "/health").status_code == 200
    srv.runtime.supervisors[0].first_delay = 3.0  # keep it down long enough to look
    srv.fault("kill")
    r = httpx.get(srv.url + "/health")
    assert r.status_code == 503 and r.json()["status"] in ("unavailable", "restarting")
    assert r.json()["engine_core"]["alive"] is False
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "service_unavailable"


def test_a_request_that_meets_the_drain_past_the_door_is_told_shutting_down(
    start_server, tiny_llama
):
    """SIGTERM's drain flags the door (the access middleware) and the runtime together; a
    request already past the door when it began is refused by the runtime, with the code a
    load balancer keys on (``shutting_down``), not the one of a dead engine core."""
    srv = start_server(tiny_llama)
    srv.runtime.draining = True  # the door let it through a moment before
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        o = httpx.post(
            srv.url + "/api/generate", json={"model": "tiny-llama", "prompt": "x", "stream": False}
        )
    finally:
        srv.runtime.draining = False
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert r.headers["retry-after"] == "5"
    assert o.status_code == 503 and "shutting down" in o.json()["error"]
    ok = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200  # nothing changed for the requests after
