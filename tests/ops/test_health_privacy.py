"""With API keys configured, /health stays public for probes but tells a caller without a
valid key only its status; the details (models, memory, load) need a key."""

from __future__ import annotations

import httpx

KEY = "sk-ops-0123456789"


def test_health_details_need_a_key(start_server, tiny_llama):
    srv = start_server(tiny_llama, security={"api_keys": [{"key": KEY, "name": "ops"}]})
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"x-api-key": "nope"}):
        r = httpx.get(srv.url + "/health", headers=headers, timeout=10)
        assert r.status_code == 200, r.text
        assert r.json() == {"status": "ok"}
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        r = httpx.get(srv.url + "/health", headers=headers, timeout=10)
        assert r.status_code == 200
        h = r.json()
        assert h["status"] == "ok" and h["model_loaded"] is True
        assert "memory" in h and {m["name"] for m in h["models"]} == {"tiny-llama"}


def test_health_without_keys_configured_is_unchanged(server):
    h = httpx.get(server.url + "/health", timeout=10).json()
    assert h["status"] == "ok" and "models" in h and "memory" in h
