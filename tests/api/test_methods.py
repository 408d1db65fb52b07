"""HEAD and 405 over every route of the app (RFC 9110 9.3.2 and 15.5.6), found by walking
``app.routes``: every GET route answers HEAD with the GET's status and headers and no body,
and every 405 carries an ``Allow`` header listing each method its path takes, with the
body in the caller's dialect."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

import httpx

# headers that differ from one response to the next whatever the method
_PER_RESPONSE = {"date", "x-request-id"}


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "no-such-x", path)


def _methods_by_path(app: Any) -> dict[str, set[str]]:
    """Each route template with the methods of all its routes (HEAD wherever GET is)."""
    from mlxd.api.middleware import iter_routes

    out: dict[str, set[str]] = defaultdict(set)
    for route in iter_routes(app.routes):
        if getattr(route, "methods", None):
            out[route.path] |= set(route.methods)
    for methods in out.values():
        if "GET" in methods:
            methods.add("HEAD")
    return dict(out)


def _assert_dialect_405(path: str, r: httpx.Response) -> None:
    body = r.json()
    if path.startswith("/api/"):
        assert set(body) == {"error"} and isinstance(body["error"], str), body
    elif path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["message"], body
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body


def test_every_get_route_answers_head_as_its_get(server):
    routes = _methods_by_path(server.app)
    gets = [p for p, m in routes.items() if "GET" in m]
    assert len(gets) > 10 and "/v1/models" in gets and "/api/tags" in gets
    with server.client() as c:
        for template in gets:
            path = _concrete(template)
            get1, get2 = c.get(path), c.get(path)
            head = c.head(path)
            get3 = c.get(path)  # a value that changed around the HEAD (an uptime) shows here
            assert head.status_code == get1.status_code, (template, head.status_code)
            assert head.content == b"", template
            assert set(head.headers) - _PER_RESPONSE == set(get1.headers) - _PER_RESPONSE, (
                template,
                head.headers,
                get1.headers,
            )
            for name in set(get1.headers) - _PER_RESPONSE - {"content-length"}:
                if get1.headers[name] == get2.headers[name] == get3.headers.get(name):
                    assert head.headers[name] == get1.headers[name], (template, name)
            # a body that changes between GETs (an uptime: its digits vary in number) may
            # change its length at the HEAD alone; only a body that stays put is compared
            if get1.content == get2.content == get3.content:
                assert head.headers.get("content-length") == get1.headers.get("content-length"), (
                    template
                )


def test_every_405_lists_the_methods_of_its_path(server):
    routes = _methods_by_path(server.app)
    assert routes["/health"] == {"GET", "HEAD"}
    assert routes["/v1/responses/{response_id}"] == {"GET", "HEAD", "DELETE"}
    with server.client() as c:
        for template, methods in routes.items():
            path = _concrete(template)
            for method in sorted({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"} - methods):
                r = c.request(method, path, json={} if method != "HEAD" else None)
                assert r.status_code == 405, (method, template, r.status_code)
                allow = {m.strip() for m in r.headers["allow"].split(",")}
                assert allow == methods, (method, template, allow)
                if method == "HEAD":
                    assert r.content == b""
                else:
                    _assert_dialect_405(template, r)


def test_head_changes_nothing_and_a_post_only_route_refuses_it(server):
    with server.client() as c:
        r = c.head("/v1/chat/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST" and r.content == b""
        r = c.head("/unload")
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        assert c.get("/api/ps").json()["models"], "a HEAD of /unload unloaded nothing"
        r = c.head("/v1/models")
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        assert int(r.headers["content-length"]) == len(c.get("/v1/models").content)
