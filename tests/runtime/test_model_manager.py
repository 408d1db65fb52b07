"""The model manager through HTTP: lazy loads, LRU + TTL + budget eviction, keep_alive."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from conftest import install_into_store, wait_until
from fixtures.tiny_models import make_tiny_chat_model


def _loaded(srv) -> list[str]:
    return sorted(m["name"] for m in srv.health()["models"])


def _chat(srv, model: str, **kw) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)


@pytest.fixture()
def store_models(tmp_path, tiny_llama):
    """Three small chat models in the store plus a slower one for long-running streams."""
    models = tmp_path / "models"
    for i, name in enumerate(("m1", "m2", "m3")):
        src = make_tiny_chat_model(tmp_path / "src" / name, "llama", seed=10 + i)
        install_into_store(models, name, src)
    slow = make_tiny_chat_model(
        tmp_path / "src" / "slow",
        "llama",
        hidden_size=256,
        num_layers=4,
        max_position_embeddings=8192,
        seed=3,
    )
    install_into_store(models, "slow", slow)
    return models


def test_lazy_load_then_lru_eviction_within_the_kind_cap(start_server, tiny_llama, store_models):
    srv = start_server(tiny_llama, models={"max_chat_models": 3})
    assert _loaded(srv) == ["tiny-llama"]  # the default is preloaded (and pinned)
    assert _chat(srv, "m1").status_code == 200
    assert _chat(srv, "m2").status_code == 200
    assert _loaded(srv) == ["m1", "m2", "tiny-llama"]
    assert _chat(srv, "m1").status_code == 200  # m1 is now more recent than m2
    assert _chat(srv, "m3").status_code == 200
    assert _loaded(srv) == ["m1", "m3", "tiny-llama"]  # m2 was least recently used
    assert srv.health()["model_evictions"] == 1
    assert _chat(srv, "m2").status_code == 200  # and comes back on demand
    assert _loaded(srv) == ["m2", "m3", "tiny-llama"]


def test_keep_alive_zero_minus_one_and_a_duration(start_server, tiny_llama, store_models):
    srv = start_server(tiny_llama)
    assert _chat(srv, "m1", keep_alive=0).status_code == 200
    assert wait_until(lambda: "m1" not in _loaded(srv), 60)  # unloaded as soon as it ended
    assert _chat(srv, "m2", keep_alive=-1).status_code == 200
    t0 = time.time()
    assert _chat(srv, "m3", keep_alive="5s").status_code == 200
    h = {m["name"]: m for m in srv.health()["models"]}
    t1 = time.time()
    assert h["m2"]["expires_at"] is None  # forever
    expires = h["m3"]["expires_at"]
    assert t0 + 5 <= expires <= t1 + 5  # 5 s after its request ended
    assert wait_until(lambda: "m3" not in _loaded(srv), 60)
    assert time.time() >= expires  # and not unloaded before then
    assert "m2" in _loaded(srv) and "tiny-llama" in _loaded(srv)


def test_default_ttl_from_settings(start_server, tiny_llama, store_models):
    srv = start_server(tiny_llama, models={"keep_alive": "1s"})
    assert _chat(srv, "m1").status_code == 200
    assert wait_until(lambda: "m1" not in _loaded(srv), 60)
    assert "tiny-llama" in _loaded(srv)  # pinned: the TTL never unloads it


def test_a_busy_model_is_never_evicted(start_server, tiny_llama, store_models):
    srv = start_server(tiny_llama, models={"max_chat_models": 3})
    assert _chat(srv, "m1").status_code == 200
    body = {"model": "slow", "prompt": "x", "max_tokens": 4000, "stream": True}
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(lines)
            # slow (busy) is more recently used than m1 is; make m1 the newer one anyway
            assert _chat(srv, "m1").status_code == 200
            assert _chat(srv, "m2").status_code == 200  # must evict: m1 goes, not slow
            assert _loaded(srv) == ["m2", "slow", "tiny-llama"]
            more = [next(lines) for _ in range(3)]
            assert all(line.startswith("data: ") or line == "" for line in more)


def test_budget_refusal_is_503_and_too_large_is_507(start_server, tiny_llama, store_models):
    from mlxd.runtime.memory import estimate_model_bytes

    small = estimate_model_bytes(store_models / "m1", upcast_half=True)
    slow = estimate_model_bytes(store_models / "slow", upcast_half=True)
    default = estimate_model_bytes(tiny_llama, upcast_half=True)
    budget = default + slow + small // 2  # room for the default and slow, not one more
    srv = start_server(tiny_llama, models={"memory_budget_bytes": budget})
    body = {"model": "slow", "prompt": "x", "max_tokens": 4000, "stream": True}
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()  # keep a reference: a dropped iterator closes the stream
            next(lines)
            r2 = _chat(srv, "m1")
            assert r2.status_code == 503
            assert "budget" in r2.json()["error"]["message"]
            assert r2.headers.get("retry-after")
    # once slow is idle it can be evicted to make room
    assert wait_until(lambda: srv.health()["requests_in_flight"] == 0, 60)
    assert _chat(srv, "m1").status_code == 200
    assert "slow" not in _loaded(srv)

    tight = start_server(tiny_llama, models={"memory_budget_bytes": default + small // 2})
    r = _chat(tight, "slow")
    assert r.status_code == 507
    assert "budget" in r.json()["error"]["message"]


def test_concurrent_first_requests_share_one_load(start_server, tiny_llama, store_models):
    srv = start_server(tiny_llama)

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            return await asyncio.gather(
                *(c.post("/v1/chat/completions", json=body) for _ in range(8))
            )

    results = asyncio.run(main())
    assert [r.status_code for r in results] == [200] * 8
    assert srv.health()["model_loads"]["m1"] == 1


def test_a_failed_load_is_a_clear_error_and_the_server_stays_healthy(
    start_server, tiny_llama, store_models
):
    (store_models / "m2" / "model.safetensors").write_bytes(b"this is not a safetensors file")
    srv = start_server(tiny_llama)

    async def main():
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            body = {"model": "m2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            return await asyncio.gather(
                *(c.post("/v1/chat/completions", json=body) for _ in range(3))
            )

    for r in asyncio.run(main()):
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["code"] == "model_load_failed" and "m2" in err["message"]
    assert httpx.get(srv.url + "/health").status_code == 200
    assert _chat(srv, "m1").status_code == 200
    assert "m2" not in _loaded(srv)


def test_unload_endpoint_frees_memory(start_server, tiny_llama, store_models):
    srv = start_server(tiny_llama)
    assert _chat(srv, "slow").status_code == 200
    before = srv.health()["memory"]["active_bytes"]
    r = httpx.post(srv.url + "/unload", json={"model": "slow"})
    assert r.status_code == 200 and r.json()["unloaded"] == ["slow"]
    assert "slow" not in _loaded(srv)
    assert srv.health()["memory"]["active_bytes"] < before
    r = httpx.post(srv.url + "/unload", json={"model": "slow"})
    assert r.status_code == 404
    r = httpx.post(srv.url + "/unload")
    assert r.status_code == 200 and r.json()["unloaded"] == ["tiny-llama"]
    assert _loaded(srv) == []
    h = httpx.get(srv.url + "/health").json()
    assert h["model_loaded"] is False
    assert _chat(srv, "m1").status_code == 200  # and everything still loads on demand


def test_keep_alive_validation(start_server, tiny_llama, store_models):
    srv = start_server(tiny_llama)
    r = _chat(srv, "m1", keep_alive="soon")
    assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"


def test_preloaded_models_are_loaded_at_start_and_pinned(start_server, tiny_llama, store_models):
    srv = start_server(
        tiny_llama, models={"preload": ["m1"], "keep_alive": "1s", "max_chat_models": 2}
    )
    h = {m["name"]: m for m in srv.health()["models"]}
    assert set(h) == {"tiny-llama", "m1"} and h["m1"]["pinned"]
    time.sleep(2)
    assert "m1" in _loaded(srv)  # pinned: no TTL
    r = _chat(srv, "m2")  # both slots pinned: nothing can be evicted
    assert r.status_code == 503 and "pinned" in r.json()["error"]["message"]


def test_openai_model_endpoints(start_server, tiny_llama, store_models):
    srv = start_server(tiny_llama)
    data = httpx.get(srv.url + "/v1/models").json()["data"]
    ids = {m["id"] for m in data}
    assert {"tiny-llama", "m1", "m2", "m3", "slow"} <= ids
    assert all(m["object"] == "model" and m["owned_by"] == "mlxd" for m in data)
    r = httpx.get(srv.url + "/v1/models/m1")
    assert r.status_code == 200 and r.json()["id"] == "m1"
    r = httpx.get(srv.url + "/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
