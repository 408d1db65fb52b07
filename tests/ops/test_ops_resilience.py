"""Out-of-memory errors and a dying device worker: the request fails clearly, the server lives."""

from __future__ import annotations

import threading

import httpx
import pytest
from conftest import LiveServer, install_into_store, make_settings, wait_until

from mlxd.enginecore.protocol import Fault, Loaded

# What MLX's Metal allocator raises when a buffer does not fit.
METAL_OOM = (
    "[metal::malloc] Attempting to allocate 68719476736 bytes which is greater "
    "than the maximum allowed buffer size of 28991029248 bytes."
)
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def srv(tmp_path_factory, tiny_llama, tiny_qwen2):
    home = tmp_path_factory.mktemp("res")
    install_into_store(home / "models", "spare", tiny_qwen2)
    s = LiveServer(make_settings(home, tiny_llama)).start()
    yield s
    s.stop()


def test_oom_in_a_decode_step_is_503_and_the_next_request_succeeds(srv):
    with srv.client() as c:
        srv.fault("step_error", model="tiny-llama", message=METAL_OOM)
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "out_of_memory" and "out of memory" in err["message"]
        assert r.headers["retry-after"] == "1"
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        srv.fault("step_error", model="tiny-llama", message=METAL_OOM)
        r = c.post("/api/chat", json={"model": "tiny-llama", "stream": False, **CHAT})
        assert r.status_code == 503 and "out of memory" in r.json()["error"]
        assert c.post("/generate", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    assert srv.health()["status"] == "ok"


def _metric(srv, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(srv.url + "/metrics").text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_oom_while_loading_is_503_and_the_next_load_succeeds(srv):
    srv.fault("load_error")
    body = {**CHAT, "model": "spare"}
    loaded = _metric(srv, "mlxd:models_loaded", kind="chat")
    with srv.client() as c:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "out_of_memory"
        assert "while loading 'spare'" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", json={**body, "keep_alive": "1s"})
        assert r.status_code == 200 and r.json()["model"] == "spare"
    # idle for its keep_alive: unloaded by the sweeper, counted as an eviction
    assert wait_until(
        lambda: _metric(srv, "mlxd:model_evictions_total", model="spare", reason="idle") == 1, 8
    )
    assert "spare" not in [m["name"] for m in srv.core(Loaded()).models]
    assert _metric(srv, "mlxd:models_loaded", kind="chat") == loaded


def _stream_until_error(url: str, body: dict, out: list, started: threading.Event) -> None:
    """Stream a chat completion; record ("done"|"error", text) as it ends."""
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
            if r.status_code != 200:
                out.append(("status", r.status_code, r.read().decode()))
                return
            text = ""
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                started.set()
                text += line
                if line == "data: [DONE]":
                    break
            out.append(("error" if '"error"' in text else "done", 200, text))
    except httpx.HTTPError as exc:
        out.append(("transport", 0, repr(exc)))


@pytest.mark.parametrize("how", ["kill", "abort", "worker"])
def test_engine_core_death_under_load_is_survivable(start_server, tiny_llama, how):
    """kill -9 / a native abort / a dead device thread, with streams in flight: every one
    ends with a clean error event, /health says 503, a new core comes up with the pinned
    model, and requests succeed again."""
    srv = start_server(tiny_llama)
    pid = srv.core_pid
    srv.fault("slow_steps", model="tiny-llama", seconds=0.02)
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 200, "stream": True}
    results: list = []
    started = [threading.Event() for _ in range(6)]
    threads = [
        threading.Thread(target=_stream_until_error, args=(srv.url, body, results, ev))
        for ev in started
    ]
    for t in threads:
        t.start()
    assert all(ev.wait(20) for ev in started)
    if how == "kill":
        import os
        import signal

        os.kill(pid, signal.SIGKILL)  # a real kill -9 from outside
    else:
        srv.fault(how)
    assert wait_until(lambda: httpx.get(srv.url + "/health").status_code == 503, 60)
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and "retry" in r.json()["error"]["message"]
    assert r.headers["retry-after"]
    for t in threads:
        t.join(30)
    assert len(results) == 6
    for kind, status, text in results:
        assert (kind, status) == ("error", 200), (kind, status, text[-300:])
        assert "service_unavailable" in text and text.endswith("data: [DONE]")
    assert wait_until(lambda: httpx.get(srv.url + "/health").status_code == 200, 30)
    h = srv.health()
    assert h["engine_core"]["pid"] != pid and h["worker_restarts"] == 1
    assert "tiny-llama" in [m["name"] for m in h["models"]]
    with srv.client() as c:
        for _ in range(3):
            r = c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        r = c.post("/api/chat", json={"model": "tiny-llama", "stream": False, **CHAT})
        assert r.status_code == 200


def test_kv_caches_count_against_the_memory_budget_and_load_is_shed(start_server, tiny_llama):
    """The budget covers the running batches' KV caches, not only the weights: when they fill
    it, a new request gets 503 + Retry-After (no device OOM), and serving resumes after."""
    srv = start_server(
        tiny_llama, models={"memory_budget_bytes": 1_200_000}, engine={"prefix_cache_bytes": 0}
    )
    srv.fault("slow_steps", model="tiny-llama", seconds=0.03)
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 120}
    statuses: list = []

    def run() -> None:
        statuses.append(
            httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60).status_code
        )

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()

    def over_budget() -> bool:  # the running batches' KV grows as the rows are prefilled
        m = srv.health()["memory"]
        return m["models_bytes"] + m["caches_bytes"] > 1_200_000

    assert wait_until(over_budget, 15)
    h = srv.health()
    assert h["models"][0]["cache_memory_bytes"]["kv_cache"] == h["memory"]["caches_bytes"]
    r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "max_tokens": 2})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert "memory budget" in r.json()["error"]["message"]
    for t in threads:
        t.join(60)
    assert statuses == [200] * 8  # the admitted ones were never put at risk
    srv.fault("slow_steps", model="tiny-llama", seconds=0)
    r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "max_tokens": 2})
    assert r.status_code == 200


def test_loading_a_model_does_not_pause_the_others(start_server, tiny_llama):
    """Model B's weights load on a loader thread: while B's load is held before it reads
    them (the ``hold_load`` drill), model A serves a whole stream, and B answers once the
    load goes on. Were the weights read on the device thread, A's stream could not run."""
    srv = start_server(tiny_llama)
    install_into_store(srv.settings.models_dir, "second", tiny_llama)
    srv.core(Fault("hold_load"))
    out: dict = {}

    def ask_b() -> None:
        out["b"] = httpx.post(
            srv.url + "/v1/chat/completions",
            timeout=120,
            json={
                "model": "second",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )

    b = threading.Thread(target=ask_b)
    b.start()
    try:
        assert wait_until(lambda: srv.core(Fault("held_loads")).held_loads == 1, 60)
        body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 40, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: {")]
        assert r.status_code == 200 and len(events) >= 40 and '"length"' in events[-1]
        assert b.is_alive() and srv.core(Fault("held_loads")).held_loads == 1  # B still loading
    finally:
        srv.core(Fault("release_load"))
        b.join(120)
    assert out["b"].status_code == 200, out["b"].text
    assert {m["name"] for m in srv.health()["models"]} >= {"tiny-llama", "second"}


def test_a_client_leaving_during_a_shared_load_does_not_cancel_it(
    start_server, tiny_llama, tmp_path
):
    """Two requests wait for the same model's load; the first one's client goes away. The
    load goes on for the other, which gets its answer, and the model is loaded once."""
    from fixtures.tiny_models import make_tiny_chat_model

    big = make_tiny_chat_model(
        tmp_path / "big-src",
        "llama",
        hidden_size=640,
        num_layers=8,
        max_position_embeddings=512,
        seed=6,
    )
    srv = start_server(tiny_llama)
    install_into_store(srv.settings.models_dir, "big", big)
    body = {"model": "big", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    out: dict = {}

    def patient() -> None:
        out["r"] = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)

    t = threading.Thread(target=patient)
    t.start()
    with pytest.raises(httpx.ReadTimeout):  # this client gives up while "big" loads
        httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=0.05)
    t.join(60)
    assert out["r"].status_code == 200, out["r"].text
    assert srv.health()["model_loads"].get("big") == 1


def test_health_code_and_status_agree_while_the_core_dies_and_returns(start_server, tiny_llama):
    """/health polled without pause while the engine core is killed and restarted: every
    answer is 200 with ok/degraded or 503 with another status, never a mix."""
    import os
    import signal

    srv = start_server(tiny_llama)
    pid = srv.core_pid
    answers: list[tuple[int, str]] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                r = c.get(srv.url + "/health")
                answers.append((r.status_code, r.json()["status"]))

    t = threading.Thread(target=poll)
    t.start()
    try:
        assert wait_until(lambda: len(answers) > 5, 30)
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: any(code == 503 for code, _ in answers), 30)
        assert wait_until(
            lambda: (
                srv.health()["engine_core"]["pid"] not in (None, pid) and answers[-1] == (200, "ok")
            ),
            60,
        )
    finally:
        stop.set()
        t.join(60)
    mixed = [a for a in answers if (a[0] == 200) != (a[1] in ("ok", "degraded"))]
    assert not mixed, mixed
    assert {a[1] for a in answers if a[0] == 503} == {"restarting"}
