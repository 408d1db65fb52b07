"""Serving under faults: a model whose weights are broken on disk, a storm of requests
beyond the queue. Each must end in a clear HTTP answer, never a hang, and the server keeps
serving everything else."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import httpx
import pytest
from conftest import install_into_store

MSGS = [{"role": "user", "content": "hello there"}]


def _wait_idle(srv, timeout: float = 30) -> dict:
    """/health once no request is in flight and no model runs or waits anything."""
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(srv.url + "/health", timeout=10).json()
        busy = h.get("requests_in_flight", 0) or any(
            m.get("running", 0) or m.get("waiting", 0) for m in h.get("models", [])
        )
        if not busy or time.monotonic() > deadline:
            return h
        time.sleep(0.1)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_broken_weights_are_a_clear_error_naming_the_model(
    start_server, tmp_path, tiny_llama, tiny_qwen2, damage
):
    """model.safetensors cut in half, or overwritten with garbage: a request for that model
    gets an error naming it, promptly; the default model is served before and after."""
    models = tmp_path / "models"
    stored = install_into_store(models, "broken-qwen", tiny_qwen2)
    weights = stored / "model.safetensors"
    if damage == "truncated":
        with weights.open("r+b") as fh:
            fh.truncate(weights.stat().st_size // 2)
    else:
        weights.write_bytes(b"\x00garbage" * 1000)
    srv = start_server(tiny_llama)
    with srv.client(timeout=60) as c:
        assert (
            c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2}).status_code
            == 200
        )
        for path, body in [
            ("/v1/chat/completions", {"model": "broken-qwen", "messages": MSGS, "max_tokens": 2}),
            ("/api/chat", {"model": "broken-qwen", "messages": MSGS, "stream": False}),
            ("/v1/messages", {"model": "broken-qwen", "messages": MSGS, "max_tokens": 2}),
        ]:
            r = c.post(path, json=body)  # an answer, not a hang until the client's timeout
            assert r.status_code >= 400, (path, r.text)
            assert "broken-qwen" in r.text, (path, r.text)
        # streamed, the error comes as the answer (before any 200) or as an event
        with c.stream(
            "POST",
            "/v1/chat/completions",
            json={"model": "broken-qwen", "messages": MSGS, "max_tokens": 2, "stream": True},
        ) as s:
            text = s.read().decode()
            assert s.status_code >= 400 or '"error"' in text
            assert "broken-qwen" in text
        # everything else keeps working, the engine core did not die for it
        pid = srv.health()["engine_core"]["pid"]
        r = c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2})
        assert r.status_code == 200
        r = c.post(
            "/api/chat",
            json={
                "model": "tiny-llama",
                "messages": MSGS,
                "stream": False,
                "options": {"num_predict": 2},
            },
        )
        assert r.status_code == 200
        h = srv.health()
        assert h["status"] == "ok" and h["engine_core"]["pid"] == pid
        assert "broken-qwen" not in [m["name"] for m in h.get("models", [])]
    # repaired in place (a fresh pull), the same name serves again
    shutil.rmtree(stored)
    install_into_store(models, "broken-qwen", tiny_qwen2)
    with srv.client(timeout=60) as c:
        r = c.post(
            "/v1/chat/completions", json={"model": "broken-qwen", "messages": MSGS, "max_tokens": 2}
        )
        assert r.status_code == 200, r.text


def test_a_storm_beyond_the_queue_gets_429_and_the_admitted_all_finish(
    start_server, long_llama: Path
):
    """2 running + 3 queued allowed, 40 at once on a model whose steps are held: the other
    35 get 429 with Retry-After while the admitted still wait for their steps (no waiting
    on a full queue), every admitted request finishes with its tokens once the steps go
    on, and the server holds nothing afterwards."""
    srv = start_server(long_llama, engine={"max_num_seqs": 2, "max_queued_requests": 3})
    srv.fault("slow_steps", model="long-llama", seconds=600)  # held until released below

    async def storm() -> tuple[list[httpx.Response], list[httpx.Response]]:
        async with httpx.AsyncClient(
            base_url=srv.url, timeout=120, limits=httpx.Limits(max_connections=64)
        ) as c:

            async def one(i: int) -> httpx.Response:
                if i % 4 == 3:  # some streamed: their refusal must come before any 200
                    req = c.build_request(
                        "POST",
                        "/v1/chat/completions",
                        json={"messages": MSGS, "max_tokens": 8, "stream": True},
                    )
                    r = await c.send(req, stream=True)
                    await r.aread()
                    return r
                return await c.post(
                    "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 8}
                )

            tasks = [asyncio.ensure_future(one(i)) for i in range(40)]
            try:
                deadline = time.monotonic() + 120  # a bound to wait only
                while sum(t.done() for t in tasks) < 35 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                early = [t.result() for t in tasks if t.done()]
            finally:
                srv.fault("slow_steps", model="long-llama", seconds=0)
            return early, list(await asyncio.gather(*tasks))

    early, results = asyncio.run(storm())
    # answered while no step ran: refusals only, every one but the 5 admitted
    assert len(early) == 35 and all(r.status_code == 429 for r in early), sorted(
        r.status_code for r in early
    )
    ok = [r for r in results if r.status_code == 200]
    refused = [r for r in results if r.status_code == 429]
    assert (len(ok), len(refused)) == (5, 35), sorted({r.status_code for r in results})
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
    for r in ok:
        if r.headers["content-type"].startswith("text/event-stream"):
            assert "data: [DONE]" in r.text and '"error"' not in r.text
        else:
            assert r.json()["usage"]["completion_tokens"] >= 1
    h = _wait_idle(srv)
    assert h["status"] == "ok" and h["requests_in_flight"] == 0
    assert all(m.get("running", 0) == 0 and m.get("waiting", 0) == 0 for m in h["models"])
    # and it serves normally afterwards
    r = httpx.post(
        srv.url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2}, timeout=60
    )
    assert r.status_code == 200


def test_a_core_that_stalls_past_the_heartbeat_timeout_serves_again(start_server, tiny_llama):
    """A core stopped for 4 s (SIGSTOP: what a swap storm, a starved CPU or a step holding
    the GIL looks like from outside) must not turn into a permanent outage: within seconds
    of it running again, either it or a new core must serve. Seen for real: on the shared
    2-core CI machine, one run of test_fuzz.py got 503 'restarting' for every operation
    after a stall, with the core's process alive and well."""
    import os
    import signal

    srv = start_server(tiny_llama)
    pid = srv.health()["engine_core"]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(4)
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 120  # a bound to wait only: no outage for good
    status = None
    while time.monotonic() < deadline:
        r = httpx.post(
            srv.url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2}, timeout=30
        )
        status = r.status_code
        if status == 200:
            break
        time.sleep(0.5)
    assert status == 200, "still refusing 2 min after the core ran again"
    assert srv.health()["status"] == "ok"
