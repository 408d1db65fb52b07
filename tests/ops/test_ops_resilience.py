"""Out-of-memory errors and a dying device worker: the request fails clearly, the server lives."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from conftest import LiveServer, install_into_store, make_settings

# What MLX's Metal allocator raises when a buffer does not fit.
METAL_OOM = ("[metal::malloc] Attempting to allocate 68719476736 bytes which is greater "
             "than the maximum allowed buffer size of 28991029248 bytes.")
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def srv(tmp_path_factory, tiny_llama, tiny_qwen2):
    home = tmp_path_factory.mktemp("res")
    install_into_store(home / "models", "spare", tiny_qwen2)
    s = LiveServer(make_settings(home, tiny_llama)).start()
    yield s
    s.stop()


def _wait(pred, timeout=15.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_oom_in_a_decode_step_is_503_and_the_next_request_succeeds(srv):
    engine = srv.runtime.models.get_loaded("tiny-llama").engine
    real_step = engine.step
    calls = []

    def failing_step():
        if not calls:
            calls.append(1)
            raise RuntimeError(METAL_OOM)
        return real_step()

    engine.step = failing_step  # the worker thread calls engine.step() each step
    try:
        with srv.client() as c:
            r = c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["code"] == "out_of_memory" and "out of memory" in err["message"]
            assert r.headers["retry-after"] == "1"
            r = c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            calls.clear()
            r = c.post("/api/chat", json={"model": "tiny-llama", "stream": False, **CHAT})
            assert r.status_code == 503 and "out of memory" in r.json()["error"]
            assert c.post("/generate", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    finally:
        del engine.step
    assert srv.health()["status"] == "ok"


def test_oom_while_loading_is_503_and_the_next_load_succeeds(srv, monkeypatch):
    import mlxd.engines.registry as registry

    real = registry.create_engine
    calls = []

    def failing_create(*args, **kwargs):
        if not calls:
            calls.append(1)
            raise MemoryError("simulated: cannot allocate the weights")
        return real(*args, **kwargs)

    monkeypatch.setattr(registry, "create_engine", failing_create)
    body = {**CHAT, "model": "spare"}
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "out_of_memory"
        assert "while loading 'spare'" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", json={**body, "keep_alive": "1s"})
        assert r.status_code == 200 and r.json()["model"] == "spare"
    # idle for its keep_alive: unloaded by the sweeper, counted as an eviction
    from mlxd.observability.metrics import model_evictions_total, models_loaded

    loaded = models_loaded.labels("chat")._value.get()
    evicted = model_evictions_total.labels("spare", "idle")
    assert _wait(lambda: evicted._value.get() == 1, 5)
    assert srv.runtime.models.get_loaded("spare") is None
    assert models_loaded.labels("chat")._value.get() == loaded - 1


def test_a_dead_worker_is_restarted_and_models_reloaded(srv):
    from mlxd.observability.metrics import worker_restarts_total

    restarts = worker_restarts_total._value.get()
    long_body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 240}
    inflight: dict = {}

    def in_flight():
        inflight["r"] = httpx.post(srv.url + "/v1/chat/completions", json=long_body, timeout=30)

    engine = srv.runtime.models.get_loaded("tiny-llama").engine
    real_step = engine.step

    def slow_step():  # keep the request running while the worker dies
        time.sleep(0.01)
        return real_step()

    engine.step = slow_step
    t = threading.Thread(target=in_flight)
    t.start()
    try:
        assert _wait(engine.has_work, 10)  # the request is in the batch
        srv.runtime.worker.inject_fault(RuntimeError("simulated device worker crash"))
        # /health tells the truth while the worker is down...
        assert _wait(lambda: httpx.get(srv.url + "/health").status_code == 503, 5)
        h = httpx.get(srv.url + "/health").json()
        assert h["status"] in ("unavailable", "restarting")
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and "retry" in r.json()["error"]["message"]
    finally:
        t.join(30)
    # ...the request it was running failed cleanly (no hang, no 500)...
    assert inflight["r"].status_code == 503, inflight["r"].text
    assert "device worker failed" in inflight["r"].json()["error"]["message"]
    # ...and it comes back by itself, with the default model loaded again
    assert _wait(lambda: httpx.get(srv.url + "/health").status_code == 200, 20)
    h = srv.health()
    assert h["worker_restarts"] == 1 and "tiny-llama" in [m["name"] for m in h["models"]]
    r = httpx.post(srv.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert worker_restarts_total._value.get() == restarts + 1
