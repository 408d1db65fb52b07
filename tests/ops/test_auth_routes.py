"""Every route the app serves refuses a missing or wrong API key, found by walking the app.

Nothing here lists routes by hand: the walk over ``app.routes`` (every method, HEAD
included, path parameters filled with dummies) is the list, so a route added tomorrow is
tested tomorrow without anyone editing this file. What *is* written down is the design's
public set (api/security.py, docs/operations.md "API keys"):

* ``GET``/``HEAD /health``: always public (a caller without a key sees only the status);
* ``/metrics``: public while ``metrics.require_key`` is false (the default, so a Prometheus
  scraper needs no secret), behind the key when it is true. Both settings run here.
* ``GET``/``HEAD`` of the web UI's page (``/``, ``/ui``, ``/ui/``) and its files
  (``/ui/static/...``): they hold no data; the page asks for a key before it reads any
  (its data, ``/ui/api/*``, is behind the key like everything else).

Anything else answering without a key is a failure of this test, and so is a route the walk
cannot see (the OpenAPI document is cross-checked against it).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import LiveServer, make_settings

KEY = "sk-test"
WRONG_CREDENTIALS: dict[str, dict[str, str]] = {
    "missing": {},
    "wrong bearer": {"Authorization": "Bearer sk-wrong"},
    "wrong x-api-key": {"x-api-key": "sk-wrong"},
    "prefix of the key": {"Authorization": f"Bearer {KEY[:-1]}"},
    "key with a suffix": {"x-api-key": KEY + "x"},
    "right key, wrong scheme": {"Authorization": f"Basic {KEY}"},
    "bearer without a token": {"Authorization": "Bearer"},
}
BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def _public(require_key: bool) -> dict[tuple[str, str], int]:
    """(method, path) pairs served without a key, exactly as the design says, with the
    status each answers."""
    out = {("GET", "/health"): 200, ("HEAD", "/health"): 200}
    if not require_key:
        out |= {("GET", "/metrics"): 200, ("HEAD", "/metrics"): 200}
    for m in ("GET", "HEAD"):  # the web UI: the page, and a file it does not have
        out |= {
            (m, "/"): 200,
            (m, "/ui/"): 200,
            (m, "/ui"): 307,
            (m, "/ui/static/{path:path}"): 404,
        }
    return out


def _concrete(path: str) -> str:
    """A template's parameters filled with dummies ('{model_id:path}' -> 'no-such-x')."""
    return re.sub(r"\{[^}]+\}", "no-such-x", path)


def served_routes(app: Any) -> list[tuple[str, str]]:
    """Every (method, path template) the app answers, HEAD included; a mount (no methods)
    is probed with every method under its prefix."""
    from mlxd.api.middleware import iter_routes

    out: list[tuple[str, str]] = []
    for route in iter_routes(app.routes):
        methods = getattr(route, "methods", None)
        if methods is None:  # a Mount: whatever is under it must be protected too
            methods = {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"}
            path = route.path.rstrip("/") + "/anything"
        else:
            path = route.path
        out += [(m, path) for m in sorted(methods)]
    return out


def _minimal(method: str, path: str) -> dict[str, Any]:
    """A body that every handler rejects in validation ({}), so with the right key nothing
    is generated, pulled, deleted or unloaded, and yet the request got past the key check."""
    return {"json": {}} if method in BODY_METHODS else {}


@pytest.fixture(scope="module", params=[False, True], ids=["metrics-public", "metrics-key"])
def keyed(request, tmp_path_factory, tiny_llama) -> Iterator[tuple[LiveServer, bool]]:
    require_key: bool = request.param
    home = tmp_path_factory.mktemp("auth")
    srv = LiveServer(
        make_settings(
            home,
            tiny_llama,
            # an admin key: past the door it may use every route (/v1/usage is for admins)
            security={"api_keys": [{"key": KEY, "name": "t", "admin": True}]},
            metrics={"require_key": require_key},
        )
    ).start()
    yield srv, require_key
    srv.stop()


def _assert_dialect(method: str, path: str, r: httpx.Response) -> None:
    """A 401 in the caller's dialect, with the header RFC 6750 asks for."""
    assert r.headers.get("www-authenticate") == "Bearer", (method, path)
    if method == "HEAD":
        return  # no body to read
    body = r.json()
    if path.startswith("/api/"):  # Ollama
        assert isinstance(body["error"], str) and "API key" in body["error"], body
    elif path == "/v1/messages" or path.startswith("/v1/messages/"):  # Anthropic
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
        assert "API key" in body["error"]["message"]
    else:  # OpenAI
        assert body["error"]["code"] == "invalid_api_key", body
        assert body["error"]["type"] == "invalid_request_error"


def test_the_walk_sees_every_documented_operation(keyed) -> None:
    """If the walk missed routes (a new router style, a mount), this fails first."""
    srv, _ = keyed
    # OpenAPI writes '{model_id}' where the route says '{model_id:path}'
    walked = {(m, re.sub(r":[^}]+}", "}", p)) for m, p in served_routes(srv.app)}
    documented = {(m.upper(), p) for p, ops in srv.app.openapi()["paths"].items() for m in ops}
    assert documented, "the OpenAPI document lists no operation"
    assert documented <= walked, documented - walked
    # the walk also reaches what the document hides (aliases, docs pages, /metrics)
    assert {
        ("GET", "/openapi.json"),
        ("GET", "/metrics"),
        ("HEAD", "/health"),
        ("POST", "/chat/completions"),
    } <= walked


def test_every_route_refuses_a_missing_or_wrong_key(keyed) -> None:
    srv, require_key = keyed
    public = _public(require_key)
    routes = served_routes(srv.app)
    assert len(routes) > 30
    checked = 0
    with srv.client() as c:
        for method, template in routes:
            path = _concrete(template)
            kw = _minimal(method, template)
            if (method, template) in public:
                r = c.request(method, path, **kw)
                assert r.status_code == public[method, template], (method, template, r.status_code)
                continue
            for what, headers in WRONG_CREDENTIALS.items():
                r = c.request(method, path, headers=headers, **kw)
                assert r.status_code == 401, (method, template, what, r.status_code)
                _assert_dialect(method, template, r)
            ok = c.request(method, path, headers={"Authorization": f"Bearer {KEY}"}, **kw)
            assert ok.status_code not in (401, 403), (method, template, ok.text)
            assert ok.status_code < 500, (method, template, ok.status_code, ok.text)
            ok2 = c.request(method, path, headers={"x-api-key": KEY}, **kw)
            assert ok2.status_code == ok.status_code, (method, template)
            checked += 1
    assert checked == len(routes) - len(public.keys() & set(routes))


def test_paths_no_route_serves_are_refused_before_routing(keyed) -> None:
    """Without a key, a 404 or 405 would tell an outsider which routes exist: the refusal
    comes first. Near-misses of the public paths are not public."""
    srv, require_key = keyed
    with srv.client() as c:
        for method, path in [
            ("GET", "/no/such/route"),
            ("GET", "/v1/chat/completions"),
            ("PUT", "/v1/models"),
            ("GET", "/health/"),
            ("GET", "/Health"),
            ("GET", "/metrics/"),
            ("GET", "/api/nothing"),
            ("DELETE", "/v1/messages/x"),
            ("POST", "/"),
            ("POST", "/ui/static/app.js"),
            ("GET", "/ui/api/nothing"),
            ("GET", "/uix"),
            ("GET", "/ui/apix"),
        ]:
            r = c.request(method, path)
            assert r.status_code == 401, (method, path, r.status_code)
            _assert_dialect(method, path, r)
        # with the key, the same requests get the router's truthful answers
        auth = {"Authorization": f"Bearer {KEY}"}
        assert c.get("/no/such/route", headers=auth).status_code == 404
        assert c.get("/v1/chat/completions", headers=auth).status_code == 405


def test_health_without_a_key_shows_only_the_status(keyed) -> None:
    srv, _ = keyed
    with srv.client() as c:
        anon = c.get("/health")
        assert anon.status_code == 200 and set(anon.json()) == {"status"}
        full = c.get("/health", headers={"x-api-key": KEY}).json()
        assert "engine_core" in full and full["status"] == anon.json()["status"]


def test_metrics_follows_require_key(keyed) -> None:
    srv, require_key = keyed
    with srv.client() as c:
        anon = c.get("/metrics")
        keyed_r = c.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert keyed_r.status_code == 200 and "mlxd:" in keyed_r.text
        if require_key:
            assert anon.status_code == 401
            assert c.get("/metrics", headers={"x-api-key": "sk-wrong"}).status_code == 401
        else:
            assert anon.status_code == 200 and "mlxd:" in anon.text
            # a wrong key on a public path is not an error either: it is simply anonymous
            assert c.get("/metrics", headers={"x-api-key": "sk-wrong"}).status_code == 200
