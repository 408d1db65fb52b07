"""Usage per API key name and model: counted per request, kept in $MLXD_HOME/mlxd.sqlite3,
read by admins at GET /v1/usage and with `mlxd usage`, on /metrics per key."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
from conftest import LiveServer, free_port, make_settings, wait_healthy, wait_until
from prometheus_client.parser import text_string_to_metric_families

from mlxd.observability.usage import UsageStore

ALICE, BOB = "sk-alice-admin", "sk-bob"
KEYS = {"api_keys": [{"key": ALICE, "name": "alice", "admin": True}, {"key": BOB, "name": "bob"}]}


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _chat(srv: LiveServer, key: str, max_tokens: int) -> dict:
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        headers=_auth(key),
        json={
            "model": "default",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def _server(home, model, **sections) -> LiveServer:
    return LiveServer(make_settings(home, model, security=KEYS, **sections)).start()


def _rows(srv: LiveServer, key: str = ALICE, **params) -> list[dict]:
    headers = _auth(key) if key else {}
    r = httpx.get(srv.url + "/v1/usage", headers=headers, params=params, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["data"]


def _key_samples(srv: LiveServer) -> dict[tuple, float]:
    """The mlxd_key_* samples by (name, key, kind), summed over models; no key in sight."""
    text = httpx.get(srv.url + "/metrics", headers=_auth(ALICE), timeout=30).text
    assert ALICE not in text and BOB not in text
    out: dict[tuple, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("mlxd_key_") and s.name.endswith("_total"):
                k = (s.name, s.labels.get("key"), s.labels.get("kind"))
                out[k] = out.get(k, 0) + s.value
    return out


def _by_key(rows: list[dict]) -> dict[str, dict]:
    return {r["key"]: r for r in rows}


def test_usage_per_key_survives_a_restart(tmp_path, tiny_llama) -> None:
    srv = _server(tmp_path, tiny_llama)
    try:
        before = _key_samples(srv)  # the registry is the process's: other tests count too
        a1, a2 = _chat(srv, ALICE, 3), _chat(srv, ALICE, 5)
        b = _chat(srv, BOB, 4)
        r = httpx.post(  # an error: a model that does not exist, under bob's key
            srv.url + "/v1/chat/completions",
            headers=_auth(BOB),
            json={"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
            timeout=60,
        )
        assert r.status_code == 404
        rows = _rows(srv, group_by="key", bucket="day")
        got = _by_key(rows)
        assert got["alice"]["requests"] == 2 and got["alice"]["errors"] == 0
        assert got["alice"]["input_tokens"] == a1["prompt_tokens"] + a2["prompt_tokens"]
        assert got["alice"]["output_tokens"] == 8
        assert got["bob"]["requests"] == 2 and got["bob"]["errors"] == 1
        assert got["bob"]["input_tokens"] == b["prompt_tokens"]
        assert got["bob"]["output_tokens"] == 4
        # by key and model: a model that resolved to none is counted under ""
        pairs = {(r["key"], r["model"]): r for r in _rows(srv)}
        assert pairs[("bob", "")]["errors"] == 1 and pairs[("bob", "")]["requests"] == 1, pairs
        assert sum(r["requests"] for r in pairs.values()) == 4

        after = _key_samples(srv)

        def grew(*labels: str | None) -> float:
            return after.get(labels, 0) - before.get(labels, 0)

        assert grew("mlxd_key_tokens_total", "alice", "output") == 8
        assert grew("mlxd_key_requests_total", "bob", None) == 2
        assert grew("mlxd_key_errors_total", "bob", None) == 1
        assert grew("mlxd_key_errors_total", "alice", None) == 0
    finally:
        srv.stop()

    db = sqlite3.connect(Path(os.environ["MLXD_HOME"]) / "mlxd.sqlite3")  # the test's own home
    try:
        stored = db.execute("SELECT key_name FROM usage_hourly").fetchall()
    finally:
        db.close()
    assert {k for (k,) in stored} == {"alice", "bob"}  # names, never the keys

    srv = _server(tmp_path, tiny_llama)  # the same home: the counts are still there, and add up
    try:
        _chat(srv, BOB, 2)
        got = _by_key(_rows(srv, group_by="key"))
        assert got["alice"]["requests"] == 2
        assert got["bob"]["requests"] == 3 and got["bob"]["output_tokens"] == 6
    finally:
        srv.stop()


def test_usage_is_for_admin_keys_only(tmp_path, tiny_llama) -> None:
    srv = _server(tmp_path, tiny_llama)
    try:
        r = httpx.get(srv.url + "/v1/usage", headers=_auth(BOB), timeout=30)
        assert r.status_code == 403
        assert r.json()["error"]["type"] == "permission_error"
        assert httpx.get(srv.url + "/v1/usage", timeout=30).status_code == 401
        bad = httpx.get(
            srv.url + "/v1/usage", headers=_auth(ALICE), params={"group_by": "user"}, timeout=30
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "group_by"
        bad = httpx.get(
            srv.url + "/v1/usage", headers=_auth(ALICE), params={"start": "yesterday"}, timeout=30
        )
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "start"
        assert httpx.get(srv.url + "/v1/usage", headers=_auth(ALICE), timeout=30).status_code == 200
    finally:
        srv.stop()


def test_usage_without_keys_answers_loopback(tmp_path, tiny_llama) -> None:
    srv = LiveServer(make_settings(tmp_path, tiny_llama)).start()
    try:
        r = httpx.post(
            srv.url + "/v1/completions",
            json={"model": "default", "prompt": "hi", "max_tokens": 2},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        rows = _rows(srv, key="", group_by="key")
        assert rows[0]["key"] == "" and rows[0]["output_tokens"] == 2
    finally:
        srv.stop()


def test_usage_without_keys_refuses_a_caller_beyond_loopback(tmp_path, tiny_llama) -> None:
    """The app itself, called in-process as if from another host (no traffic leaves)."""
    import asyncio

    from mlxd.api.app import create_app

    app = create_app(make_settings(tmp_path, tiny_llama))

    async def ask() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=("192.0.2.7", 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            return await c.get("/v1/usage")

    r = asyncio.run(ask())
    assert r.status_code == 403, r.text
    assert "loopback" in r.json()["error"]["message"]


def test_cli_usage_by_key_and_by_model(tmp_path, tiny_llama) -> None:
    srv = _server(tmp_path, tiny_llama)
    try:
        _chat(srv, ALICE, 3)
        _chat(srv, BOB, 2)
        env = dict(os.environ, MLXD_API_KEY=ALICE)

        def mlxd(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                [sys.executable, "-m", "mlxd", "usage", "--port", str(srv.port), *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )

        out = mlxd("--by", "key")
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].split() == ["KEY", "REQUESTS", "ERRORS", "INPUT", "OUTPUT"]
        rows = {line.split()[0]: line.split() for line in lines[1:]}
        assert rows["alice"][1] == "1" and rows["alice"][4] == "3"
        assert rows["bob"][4] == "2"

        out = mlxd("--by", "model", "--since", "1d", "--json")
        assert out.returncode == 0, out.stderr
        data = json.loads(out.stdout)["data"]
        assert len(data) == 1 and data[0]["requests"] == 2 and data[0]["output_tokens"] == 5

        env["MLXD_API_KEY"] = BOB
        out = mlxd()
        assert out.returncode == 1
        assert "403" in out.stderr and "admin" in out.stderr
        assert mlxd("--since", "soon").returncode != 0
    finally:
        srv.stop()


def test_retention_prunes_old_hours(tmp_path) -> None:
    """Unit: rows older than the retention go at the next flush; newer ones stay."""
    day = 86400
    now = 1_800_000_000.0
    store = UsageStore(tmp_path / "mlxd.sqlite3", retention_days=2)
    try:
        store.record("k", "m", 10, 5, False, now=now - 3 * day)
        store.record("k", "m", 1, 1, True, now=now - 1 * day)
        store.record("k", "m", 2, 2, False, now=now)
        store.record("k", "m", 2, 2, False, now=now)
        store.flush(now=now - 3 * day)  # then, nothing was old
        assert sum(r["requests"] for r in store.query(0, now + day, [])) == 4
        store.flush(now=now)
        rows = store.query(0, now + day, [], bucket="hour")
        assert [r["requests"] for r in rows] == [1, 2]
        assert [r["errors"] for r in rows] == [1, 0]
        assert rows[1]["input_tokens"] == 4
        days = store.query(now - 10 * day, now + day, ["key", "model"], bucket="day")
        assert all(r["start"] % day == 0 for r in days)
    finally:
        store.close()


def test_several_front_ends_add_into_the_same_rows(tmp_path, tiny_llama) -> None:
    """`--api-workers 2`: each front end writes its own counts into the shared rows (an
    upsert that adds); the totals reach what was sent, whichever front end answered."""
    port = free_port()
    env = dict(
        os.environ,
        MLXD_API_KEYS=f"alice:{ALICE} admin,bob:{BOB}",
        MLXD_USAGE__FLUSH_INTERVAL_S="0.2",
        HF_HUB_OFFLINE="1",
    )
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlxd", "serve", "--model", str(tiny_llama)]
            + ["--port", str(port), "--api-workers", "2"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, 180, lambda: log.read_text()[-3000:])
        for _ in range(6):  # new connections: the kernel spreads them over the workers
            r = httpx.post(
                url + "/v1/chat/completions",
                headers=_auth(BOB),
                json={
                    "model": "default",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                },
                timeout=120,
            )
            assert r.status_code == 200, r.text

        def bob() -> dict:
            r = httpx.get(
                url + "/v1/usage", headers=_auth(ALICE), params={"group_by": "key"}, timeout=30
            )
            assert r.status_code == 200, r.text
            return _by_key(r.json()["data"]).get("bob", {})

        assert wait_until(lambda: bob().get("requests") == 6, timeout=60), bob()
        assert bob()["output_tokens"] == 12
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
