"""The web UI's routes over HTTP (no browser): what is public, what needs a key, the
request list and the stats ring, ``server.ui: false`` (on the app, and on a running server
through the environment), and the vendored files' checksums.
tests/ui/test_ui_browser.py drives the page itself."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import httpx
import pytest
from conftest import LiveServer, make_settings
from fastapi.testclient import TestClient

from mlxd.observability.history import Reading, point
from mlxd.ui import STATIC_DIR

KEY = "routes-key"


@pytest.fixture(scope="module")
def srv(tmp_path_factory, tiny_llama):
    s = make_settings(
        tmp_path_factory.mktemp("home"), tiny_llama, security={"api_keys": [f"route-tester:{KEY}"]}
    )
    server = LiveServer(s).start()
    yield server
    server.stop()


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def test_the_page_and_its_files_load_without_a_key(srv):
    for path in ("/", "/ui/"):
        r = httpx.get(srv.url + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert '<script type="module" src="/ui/static/app.js">' in r.text
        # nothing from elsewhere may load: no CDN, no injected script
        assert "default-src 'self'" in r.headers["content-security-policy"]
    assert httpx.get(srv.url + "/ui").headers["location"] == "/ui/"
    for f in ("app.js", "style.css", "vendor/uPlot.iife.min.js"):
        assert httpx.get(f"{srv.url}/ui/static/{f}").status_code == 200
    assert httpx.get(srv.url + "/ui/static/nope.js").status_code == 404
    # nothing outside the static folder (the package's Python files are next to it)
    for escape in ("%2e%2e/__init__.py", "..%2f__init__.py", "%2e%2e%2f%2e%2e%2fconfig.py"):
        r = httpx.get(f"{srv.url}/ui/static/{escape}")
        assert r.status_code == 404 and "STATIC_DIR" not in r.text, escape
    js = httpx.get(srv.url + "/ui/static/app.js")
    assert js.headers["cache-control"] == "no-cache" and js.headers["etag"]
    assert (
        httpx.get(
            srv.url + "/ui/static/app.js", headers={"If-None-Match": js.headers["etag"]}
        ).status_code
        == 304
    )


def test_the_data_needs_the_key(srv):
    for path in ("/ui/api/overview", "/ui/api/stats", "/ui/api/requests"):
        r = httpx.get(srv.url + path)
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert (
            httpx.get(srv.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        )
        assert httpx.get(srv.url + path, headers=auth()).status_code == 200


def test_overview(srv):
    o = httpx.get(srv.url + "/ui/api/overview", headers=auth()).json()
    assert o["version"] and o["backend"] == "cpu" and o["blas"] not in ("", "unknown")
    assert o["health"]["status"] == "ok" and o["health"]["memory"]["budget_bytes"] > 0
    assert [m["name"] for m in o["health"]["models"]] == ["tiny-llama"]
    assert o["key_name"] == "route-tester"


def test_requests_list_the_traffic_with_its_log_line(srv):
    with srv.client(headers=auth()) as c:
        r = c.post(
            "/v1/chat/completions",
            headers={"X-Request-ID": "ui-rid-1"},
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert r.status_code == 200
        c.get("/ui/api/stats")  # the UI's own calls are not listed
        items = c.get("/ui/api/requests", params={"limit": 5}).json()["requests"]
    first = items[0]
    assert first["request_id"] == "ui-rid-1" and first["route"] == "/v1/chat/completions"
    assert first["status"] == 200 and first["model"] == "tiny-llama"
    assert first["key"] == "route-tester" and first["completion_tokens"] == 3
    assert first["line"].startswith("POST /v1/chat/completions 200 ")
    assert "rid=ui-rid-1" in first["line"] and "key=route-tester" in first["line"]
    assert not any(i["route"].startswith("/ui/") for i in items)
    assert (
        httpx.get(srv.url + "/ui/api/requests", params={"limit": 0}, headers=auth()).status_code
        == 400
    )  # a bad query is a clear 4xx


def test_stats_sample_the_servers_own_counters(srv):
    with srv.client(headers=auth()) as c:
        t0 = time.time()
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16},
        )
        assert r.status_code == 200
        deadline = time.time() + 15
        while time.time() < deadline:
            stats = c.get("/ui/api/stats", params={"since": t0}).json()
            tokens = sum(p["tokens_per_s"] for p in stats["points"])
            ok = sum(p["requests"].get("2xx", 0) for p in stats["points"])
            if tokens > 0 and ok >= 1:
                break
            time.sleep(0.5)
    assert tokens > 0 and ok >= 1, stats
    assert stats["interval_s"] == 2.0
    assert any(p["ttft_ms"] for p in stats["points"])
    assert all(p["t"] > t0 for p in stats["points"])


def test_points_between_readings():
    a = Reading(
        t=10.0,
        generation_tokens=100,
        prompt_tokens=50,
        ttft_sum=1.0,
        ttft_count=4,
        running=1,
        waiting=0,
        by_status={"2xx": 5},
    )
    b = Reading(
        t=12.0,
        generation_tokens=140,
        prompt_tokens=50,
        ttft_sum=1.5,
        ttft_count=6,
        running=2,
        waiting=3,
        by_status={"2xx": 7, "5xx": 1},
    )
    p = point(a, b)
    assert p["tokens_per_s"] == 20.0 and p["prompt_tokens_per_s"] == 0.0
    assert p["ttft_ms"] == 250.0  # (1.5 - 1.0) s over the 2 requests that started
    assert p["running"] == 2 and p["waiting"] == 3
    assert p["requests"] == {"2xx": 2.0, "5xx": 1.0}
    assert point(b, b)["ttft_ms"] is None  # no first token in the interval: no mean


def test_ui_off_is_404(tmp_path, tiny_llama):
    from mlxd.api.app import create_app

    s = make_settings(tmp_path, tiny_llama, server={"ui": False})
    # no lifespan: the routes alone; addressed as localhost (a loopback server refuses
    # TestClient's default Host, testserver)
    client = TestClient(create_app(s), base_url="http://localhost")
    for path in ("/", "/ui/", "/ui/static/app.js", "/ui/api/overview", "/ui/api/stats"):
        assert client.get(path).status_code == 404, path


@pytest.mark.slow  # a server of its own
def test_ui_off_on_a_running_server(start_server, tiny_llama, monkeypatch):
    """The switch as an operator flips it (the environment), on a server that started:
    the page, its files and its data routes are gone while the API still answers."""
    monkeypatch.setenv("MLXD_SERVER__UI", "false")
    srv = start_server(tiny_llama)
    assert srv.settings.server.ui is False
    with srv.client() as c:
        for path in (
            "/",
            "/ui/",
            "/ui/static/app.js",
            "/ui/api/overview",
            "/ui/api/requests",
            "/ui/api/stats",
        ):
            r = c.get(path)
            assert r.status_code == 404, path
            assert r.json()["error"]["type"] == "invalid_request_error", path  # OpenAI's
        assert c.get("/health").json()["status"] == "ok"
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny-llama"]
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_vendored_files_match_their_checksums():
    vendor = STATIC_DIR / "vendor"
    lines = (vendor / "SHA256SUMS").read_text().splitlines()
    assert len(lines) == 3
    for line in lines:
        digest, name = line.split()
        assert hashlib.sha256((vendor / name).read_bytes()).hexdigest() == digest, name
    for lic in ("LICENSE.htm", "LICENSE.preact", "LICENSE.uPlot"):
        assert (vendor / lic).is_file()
    assert "VENDORED.md" in {p.name for p in Path(vendor).iterdir()}
