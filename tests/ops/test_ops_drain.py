"""A real `mlxd serve` (one front end or `--api-workers 2`) through its end: the drain on
SIGTERM in every front end, streams the grace cut short, a front end killed from outside,
and /health while the engine core dies and comes back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import core_call, free_port, wait_healthy, wait_until

from mlxd.enginecore.protocol import Fault

CHAT = [{"role": "user", "content": "go"}]


def _serve(
    tmp_path: Path, model: Path, workers: int, **env_extra: str
) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXD_")}
    env.update(
        MLXD_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1", MLXD_TEST_FAULTS="1", **env_extra
    )
    log = tmp_path / "serve.log"
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlxd",
            "serve",
            "--model",
            str(model),
            "--port",
            str(port),
            "--api-workers",
            str(workers),
        ],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, p, 120, log.read_text)
    return p, url, log


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)


def _clients_on(url: str, pids: set[int], per_pid: int) -> list[tuple[int, httpx.Client]]:
    """``per_pid`` clients per front end, each on a kept-alive connection to it."""
    out: list[tuple[int, httpx.Client]] = []
    want = dict.fromkeys(pids, per_pid)
    deadline = time.time() + 60
    while any(want.values()):
        assert time.time() < deadline, want
        c = httpx.Client(
            base_url=url, timeout=120, limits=httpx.Limits(keepalive_expiry=600)
        )  # stays on that one
        pid = c.get("/health").json()["frontend_pid"]
        if want.get(pid):
            want[pid] -= 1
            out.append((pid, c))
        else:
            c.close()
    return out


def _front_ends(url: str, n: int) -> set[int]:
    """The pids of the ``n`` front ends, each met on a fresh connection."""
    pids: set[int] = set()
    deadline = time.time() + 60
    while len(pids) < n:
        assert time.time() < deadline, pids
        h = httpx.get(url + "/health", timeout=10)
        if h.status_code == 200:
            pids.add(h.json()["frontend_pid"])
    return pids


# dialect -> (path, body): a stream in each dialect, its chunks' own format
STREAMS = {
    "openai": ("/v1/chat/completions", {"messages": CHAT, "stream": True}),
    "ollama": ("/api/chat", {"model": "tiny-llama", "messages": CHAT, "stream": True}),
    "anthropic": ("/v1/messages", {"model": "tiny-llama", "messages": CHAT, "stream": True}),
}


def _stream(
    c: httpx.Client, dialect: str, max_tokens: int, out: dict, started: threading.Event
) -> None:
    path, body = STREAMS[dialect]
    body = {**body, "max_tokens": max_tokens}
    if dialect == "ollama":
        body = {**body, "options": {"num_predict": max_tokens}}
        del body["max_tokens"]
    lines: list[str] = []
    try:
        with c.stream("POST", path, json=body) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started.set()
    except httpx.HTTPError as exc:
        out["transport"] = repr(exc)
    out["lines"] = lines
    started.set()


def _ended_with_error(dialect: str, lines: list[str]) -> bool:
    if dialect == "openai":
        return (
            len(lines) >= 2
            and lines[-1] == "data: [DONE]"
            and "shutting_down" in lines[-2]
            and '"error"' in lines[-2]
        )
    if dialect == "ollama":
        return "shut down" in json.loads(lines[-1]).get("error", "")
    return lines[-2] == "event: error" and json.loads(lines[-1][6:])["type"] == "error"


def _finished(dialect: str, lines: list[str]) -> bool:
    if dialect == "openai":
        return lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2]
    if dialect == "ollama":
        return json.loads(lines[-1])["done"] is True
    return lines[-1] == "data: " + json.dumps({"type": "message_stop"}, separators=(",", ":"))


@pytest.mark.parametrize(
    "workers,group",
    [(1, False), (2, False), (2, True)],
    ids=["one-front-end", "two-front-ends", "ctrl-c-to-the-group"],
)
def test_sigterm_drains_every_front_end_and_the_grace_cuts_streams_cleanly(
    tmp_path, tiny_llama, workers, group
):
    """SIGTERM to the server (or SIGINT to its whole process group, as a terminal's Ctrl-C
    sends it): at once /health is 503 "draining" and a new request 503 + Retry-After in
    its dialect while the socket stays open; short streams finish; streams the grace
    (3 s here) cuts end with an error event in their dialect; no traceback; exit."""
    p, url, log = _serve(tmp_path, tiny_llama, workers, MLXD_SERVER__SHUTDOWN_GRACE_S="3")
    try:
        pids = _front_ends(url, workers)
        core_call(url, Fault("slow_steps", model="tiny-llama", seconds=0.05))
        # per front end: a short stream and a long one in each dialect
        jobs = []
        for pid, c in _clients_on(url, pids, 1 + len(STREAMS)):
            n_there = sum(1 for j in jobs if j[0] == pid)
            dialect, tokens = ("openai", 4) if n_there == 0 else (list(STREAMS)[n_there - 1], 200)
            out: dict = {}
            started = threading.Event()
            t = threading.Thread(target=_stream, args=(c, dialect, tokens, out, started))
            t.start()
            jobs.append((pid, dialect, tokens, out, started, t))
        assert all(j[4].wait(60) for j in jobs)
        if group:  # each front end gets it too, besides the supervisor's drain event
            os.killpg(p.pid, signal.SIGINT)
        else:
            p.send_signal(signal.SIGTERM)
        refusals = {}
        for path, body in [
            (STREAMS["openai"][0], {"messages": CHAT, "max_tokens": 1}),
            ("/api/chat", {"model": "tiny-llama", "messages": CHAT, "stream": False}),
            ("/v1/messages", {"model": "tiny-llama", "messages": CHAT, "max_tokens": 1}),
        ]:
            deadline = time.time() + 30
            while True:  # admitted only until the signal is seen; never refused meanwhile
                assert time.time() < deadline
                r = httpx.post(url + path, json=body, timeout=60)
                if r.status_code == 503:
                    refusals[path] = r
                    break
                assert r.status_code == 200, r.text
        for r in refusals.values():
            assert r.headers["retry-after"] == "5" and r.headers["connection"] == "close"
        assert refusals["/v1/chat/completions"].json()["error"]["code"] == "shutting_down"
        assert "shutting down" in refusals["/api/chat"].json()["error"]
        assert refusals["/v1/messages"].json()["type"] == "error"
        assert refusals["/v1/messages"].json()["error"]["type"] == "overloaded_error"
        for _ in range(4):  # every front end says it drains (fresh connections)
            h = httpx.get(url + "/health", timeout=10)
            assert (h.status_code, h.json()["status"]) == (503, "draining")
        for *_, t in jobs:
            t.join(120)
        for _pid, dialect, tokens, out, _, _ in jobs:
            assert out.get("status") == 200 and "transport" not in out, out
            if tokens < 100:
                assert _finished(dialect, out["lines"]), (dialect, out["lines"][-3:])
            else:
                assert _ended_with_error(dialect, out["lines"]), (dialect, out["lines"][-3:])
        assert p.wait(60) in (0, -signal.SIGTERM, -signal.SIGINT)
    finally:
        _stop(p)
    text = log.read_text()
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text
    assert text.count("shutting down: new requests get 503") == workers
    over = [line for line in text.splitlines() if "grace period" in line]
    assert len(over) == workers and all(
        "ending 3 request(s) with an error" in line for line in over
    ), over


def _gauge(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    )


def test_a_killed_front_end_leaves_no_gauges_and_is_counted(tmp_path, tiny_llama):
    """kill -9 of one of two front ends with requests running and waiting there: the
    engine core drops its requests, its gauges leave /metrics, another front end takes its
    place and /health counts that restart apart from the engine core's."""
    p, url, _ = _serve(tmp_path, tiny_llama, 2, MLXD_ENGINE__MAX_NUM_SEQS="2")
    try:
        victim, _other = sorted(_front_ends(url, 2))
        # 0.3 s a step: the victim's requests would hold the core for minutes
        core_call(url, Fault("slow_steps", model="tiny-llama", seconds=0.3))
        threads = []
        for _, c in _clients_on(url, {victim}, 5):
            t = threading.Thread(target=_stream, args=(c, "openai", 200, {}, threading.Event()))
            t.start()
            threads.append(t)
        assert wait_until(
            lambda: (
                (_gauge(url, "mlxd:num_requests_running"), _gauge(url, "mlxd:num_requests_waiting"))
                == (2, 3)
            )
        )
        os.kill(victim, signal.SIGKILL)
        for t in threads:
            t.join(60)
        assert wait_until(
            lambda: httpx.get(url + "/health", timeout=10).json()["requests_in_flight"] == 0, 20
        )

        def replaced() -> bool:
            h = httpx.get(url + "/health", timeout=10)
            return h.status_code == 200 and h.json()["front_ends"] == {"workers": 2, "restarts": 1}

        assert wait_until(replaced)
        assert victim not in _front_ends(url, 2)
        assert _gauge(url, "mlxd:num_requests_running") == 0
        assert _gauge(url, "mlxd:num_requests_waiting") == 0
        assert httpx.get(url + "/health", timeout=10).json()["worker_restarts"] == 0
        r = httpx.post(
            url + "/v1/chat/completions", timeout=60, json={"messages": CHAT, "max_tokens": 2}
        )
        assert r.status_code == 200, r.text
        p.send_signal(signal.SIGTERM)  # the dead front end does not hold up the stop
        assert p.wait(60) == 0
    finally:
        _stop(p)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")


def test_no_front_end_outlives_its_supervisor(tmp_path, tiny_llama):
    """kill -9 of the `mlxd serve` process of two front ends: the front ends and the
    engine core exit (none keeps the port answering 503 for no one)."""
    p, url, _ = _serve(tmp_path, tiny_llama, 2)
    try:
        pids = _front_ends(url, 2)
        pids.add(httpx.get(url + "/health", timeout=10).json()["engine_core"]["pid"])
        os.kill(p.pid, signal.SIGKILL)
        p.wait(30)
        assert wait_until(lambda: all(_gone(pid) for pid in pids), 60), pids
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=10)
    finally:
        _stop(p)
