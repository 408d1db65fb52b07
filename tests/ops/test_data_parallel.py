"""Several engine cores on one host (``engine.devices: cpu:2``): both serve, a conversation
stays with the core holding its prefix, one core's death ends only its own requests, and
/health, /api/ps and ``mlxd ps`` show every core."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import LiveServer, install_into_store, make_settings, wait_until

from mlxd.enginecore.protocol import Status


@pytest.fixture(scope="module")
def dp(tmp_path_factory, tiny_llama, tiny_qwen2):
    home = tmp_path_factory.mktemp("dp")
    install_into_store(home / "models", "spare", tiny_qwen2)
    srv = LiveServer(
        make_settings(
            home,
            tiny_llama,
            engine={
                "devices": "cpu:2",
                "prefix_cache_min_tokens": 32,
                "prefix_cache_disk_min_tokens": 32,
            },
        )
    ).start()
    yield srv
    srv.stop()


def _totals(srv) -> list[int]:
    return [c["requests_total"] for c in srv.health()["engine_cores"]]


def _chat(srv, messages, **kw) -> dict:
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        timeout=60,
        json={"messages": messages, "max_tokens": 6, "temperature": 0, **kw},
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_health_api_ps_and_mlxd_ps_show_every_core(dp, tmp_path):
    h = dp.health()
    cores = h["engine_cores"]
    assert [c["device"] for c in cores] == ["cpu:0", "cpu:1"]
    assert [c["index"] for c in cores] == [0, 1]
    pids = [c["pid"] for c in cores]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert all(c["state"] == "ok" and c["models"] == ["tiny-llama"] for c in cores)
    assert h["status"] == "ok" and h["engine_core"]["pid"] == pids[0]
    # each core loaded its own copy; the model is listed once, naming both cores
    assert h["model_loads"]["tiny-llama"] == 2  # (another test may have loaded "spare")
    assert [(m["name"], m["engine_cores"]) for m in h["models"]] == [("tiny-llama", [0, 1])]
    from prometheus_client.parser import text_string_to_metric_families

    families = {
        f.name: f for f in text_string_to_metric_families(httpx.get(dp.url + "/metrics").text)
    }
    loaded = [s for s in families["mlxd:models_loaded"].samples if s.labels["kind"] == "chat"]
    assert sorted((s.labels["engine_core"], s.value) for s in loaded) == [("0", 1), ("1", 1)]
    ps = httpx.get(dp.url + "/api/ps").json()
    assert [m["name"] for m in ps["models"]] == ["tiny-llama"]
    assert ps["models"][0]["engine_cores"] == [0, 1]
    assert [c["pid"] for c in ps["engine_cores"]] == pids
    env = dict(os.environ, MLXD_HOME=str(tmp_path / "cli-home"), MLXD_SERVER__PORT=str(dp.port))
    out = subprocess.run(
        [sys.executable, "-m", "mlxd", "ps"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    rows = [line.split() for line in out.splitlines()]
    assert ["CORE", "DEVICE", "PID", "STATE", "REQUESTS", "RESTARTS", "MODELS"] in rows
    # another test may have loaded "spare" beside tiny-llama: the models column lists both
    for i in (0, 1):
        row = next(r for r in rows if r[:3] == [str(i), f"cpu:{i}", str(pids[i])])
        # a core another test killed shows its restart: the count /health gives
        restarts = str(httpx.get(dp.url + "/health").json()["engine_cores"][i]["restarts"])
        assert row[3:6] == ["ok", "0", restarts] and "tiny-llama" in " ".join(row[6:]), row


def test_concurrent_requests_use_both_cores_with_the_same_greedy_output(dp):
    before = _totals(dp)
    msgs = [{"role": "user", "content": "hi"}]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: _chat(dp, msgs, max_tokens=8), range(8)))
    after = _totals(dp)
    served = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(served) == 8 and min(served) >= 2, served
    texts = {a["choices"][0]["message"]["content"] for a in answers}
    assert len(texts) == 1 and all(a["usage"]["completion_tokens"] == 8 for a in answers)


def test_a_conversations_next_turn_goes_to_the_core_holding_its_prefix(dp):
    first_cores = []
    for i in range(4):
        words = " ".join(f"topic{i} word{j} alpha{i * j}" for j in range(8))
        msgs = [{"role": "user", "content": f"Conversation {i}: {words}"}]
        before = _totals(dp)
        turn1 = _chat(dp, msgs)
        assert turn1["usage"]["prompt_tokens"] >= 64
        mid = _totals(dp)
        core = [a - b for a, b in zip(mid, before, strict=True)].index(1)
        msgs += [turn1["choices"][0]["message"], {"role": "user", "content": "and then?"}]
        turn2 = _chat(dp, msgs)
        after = _totals(dp)
        assert [a - b for a, b in zip(after, mid, strict=True)].index(1) == core
        # ... where its prefix cache answers for the shared part of the prompt
        assert turn2["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
        first_cores.append(core)
    assert set(first_cores) == {0, 1}  # new conversations still spread over the cores
    # each core keeps its prefix cache's disk tier in a folder of its own (two processes
    # must not bound and evict one folder's files each on its own count)
    root = dp.settings.engine.prefix_cache_dir
    assert wait_until(
        lambda: all(any((root / d).rglob("*.safetensors")) for d in ("cpu-0", "cpu-1"))
    )
    assert not any(root.glob("*/*.safetensors"))  # nothing in a shared fingerprint folder


def test_a_cache_salt_routes_by_its_own_prefixes(dp):
    """The same prompt under another cache_salt is not pulled to the core holding the
    first salt's prefix (that cache could not serve it); each salt's next turn goes back
    to its own core and hits there."""
    words = " ".join(f"salted word{j} beta{j * 7}" for j in range(10))
    msgs = [{"role": "user", "content": f"A salted conversation: {words}"}]
    cores = {}
    for salt in ("a", "b"):
        # idle cores as the router sees them: a stale load must not decide the pick
        assert wait_until(lambda: [c.load for c in dp.runtime.cores.clients] == [0, 0])
        before = _totals(dp)
        turn1 = _chat(dp, msgs, cache_salt=salt)
        assert turn1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        cores[salt] = [a - b for a, b in zip(_totals(dp), before, strict=True)].index(1)
    assert cores["a"] != cores["b"]
    for salt in ("a", "b"):
        before = _totals(dp)
        turn2 = _chat(
            dp,
            msgs
            + [{"role": "assistant", "content": "Yes."}, {"role": "user", "content": "and then?"}],
            cache_salt=salt,
        )
        assert [a - b for a, b in zip(_totals(dp), before, strict=True)].index(1) == cores[salt]
        assert turn2["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32


def _holders(srv, model: str) -> list[int]:
    return next((m["engine_cores"] for m in srv.health()["models"] if m["name"] == model), [])


def test_model_management_reaches_every_core(dp):
    """A request's model loads on the core that serves it (once); unload reaches every
    core; Ollama's load without a prompt loads it on every core."""
    httpx.post(dp.url + "/unload", json={"model": "spare"}, timeout=60)  # whatever came before
    assert _holders(dp, "spare") == []
    loads = dp.health()["model_loads"].get("spare", 0)
    _chat(dp, [{"role": "user", "content": "hi"}], model="spare")
    # one core holds it (request totals would not say which: another test's request may
    # still end on either core meanwhile)
    assert len(_holders(dp, "spare")) == 1
    assert dp.health()["model_loads"]["spare"] == loads + 1
    r = httpx.post(dp.url + "/api/generate", json={"model": "spare"}, timeout=60)
    assert r.status_code == 200 and r.json()["done_reason"] == "load"
    assert _holders(dp, "spare") == [0, 1]
    r = httpx.post(dp.url + "/unload", json={"model": "spare"}, timeout=60)
    assert r.status_code == 200 and r.json()["unloaded"] == ["spare"]
    assert _holders(dp, "spare") == []
    assert all(c["models"] == ["tiny-llama"] for c in dp.health()["engine_cores"])


def _stream(url: str, body: dict, out: list, started: threading.Event) -> None:
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        text = ""
        for line in r.iter_lines():
            if line.startswith("data: "):
                started.set()
                text += line
        out.append((r.status_code, "error" if '"error"' in text else "done", text))


def test_a_killed_core_ends_only_its_streams_and_comes_back(dp):
    pids = dp.core_pids
    dp.runtime.supervisors[1].first_delay = 3.0  # down long enough to serve without it
    for i in (0, 1):
        dp.fault("slow_steps", index=i, model="tiny-llama", seconds=0.02)
    results: list = []
    started = [threading.Event() for _ in range(6)]
    threads = [
        threading.Thread(
            target=_stream,
            args=(
                dp.url,
                {
                    "messages": [{"role": "user", "content": f"story {n}"}],
                    "max_tokens": 150,
                    "stream": True,
                },
                results,
                ev,
            ),
        )
        for n, ev in enumerate(started)
    ]
    for t in threads:
        t.start()
    assert all(ev.wait(30) for ev in started)
    on_killed = dp.core(Status(), index=1).requests_in_flight
    assert 1 <= on_killed <= 5
    os.kill(pids[1], signal.SIGKILL)
    assert wait_until(lambda: dp.health()["engine_cores"][1]["state"] != "ok", 60)
    r = httpx.get(dp.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "degraded"
    # the other core keeps serving new requests meanwhile
    assert _chat(dp, [{"role": "user", "content": "still there?"}])["choices"]
    for t in threads:
        t.join(60)
    assert (
        sorted(kind for _, kind, _ in results) == ["done"] * (6 - on_killed) + ["error"] * on_killed
    )
    for status, kind, text in results:
        assert status == 200 and text.endswith("data: [DONE]")
        if kind == "error":
            assert "service_unavailable" in text
    assert wait_until(lambda: dp.health()["status"] == "ok", 60)
    cores = dp.health()["engine_cores"]
    assert cores[0]["pid"] == pids[0] and cores[1]["pid"] not in (None, pids[1])
    assert [c["restarts"] for c in cores] == [0, 1] and cores[1]["models"] == ["tiny-llama"]
    dp.fault("slow_steps", index=0, model="tiny-llama", seconds=0)
    before = _totals(dp)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda n: _chat(dp, [{"role": "user", "content": f"again {n}"}]), range(4)))
    assert all(a > b for a, b in zip(_totals(dp), before, strict=True))
    assert dp.health()["worker_restarts"] == 1
