"""API keys, rate limits, body/max_tokens/inputs limits and CORS, through real HTTP."""

from __future__ import annotations

import logging
import os
import re
import time

import pytest
from conftest import LiveServer, make_settings

ALICE, BOB, CAROL = "sk-alice-0123456789", "sk-bob-0123456789", "sk-carol-0123456789"


@pytest.fixture(scope="module")
def secured(tmp_path_factory, tiny_llama):
    home = tmp_path_factory.mktemp("sec")
    keyfile = home / "keys.txt"
    keyfile.write_text("# team keys\nerin:sk-erin-0123\n\nsk-frank-0123\n")
    old = os.environ.get("MLXD_API_KEYS")
    os.environ["MLXD_API_KEYS"] = "dave:sk-dave-0123"
    try:
        settings = make_settings(
            home,
            tiny_llama,
            security={
                "api_keys": [
                    {"key": ALICE, "name": "alice"},
                    {"key": BOB, "name": "bob", "requests_per_minute": 2},
                    {"key": CAROL, "name": "carol", "tokens_per_minute": 30},
                ],
                "api_key_file": str(keyfile),
                "max_body_bytes": 4096,
                "max_tokens_limit": 64,
                "max_inputs": 4,
                "cors_origins": ["http://ui.example"],
            },
        )
        srv = LiveServer(settings).start()
    finally:
        if old is None:
            os.environ.pop("MLXD_API_KEYS", None)
        else:
            os.environ["MLXD_API_KEYS"] = old
    yield srv
    srv.stop()


# routes that take an admin key: any other valid key gets a 403 (or a 400 for its body first)
ADMIN_ONLY = {"/v1/usage", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x", path)


def _routes(app):
    """Every (method, path) the app serves, from app.routes (included routers unwrapped)."""
    from mlxd.api.middleware import iter_routes

    out = []
    for route in iter_routes(app.routes):
        for method in sorted(getattr(route, "methods", None) or ()):
            if method != "HEAD":
                out.append((method, route.path))
    return out


def test_every_route_is_protected_except_health_and_metrics(secured):
    routes = _routes(secured.app)
    paths = {p for _, p in routes}
    assert {"/v1/chat/completions", "/api/chat", "/generate", "/health", "/metrics"} <= paths
    # a body that passes no route's validation, so nothing is loaded, pulled or unloaded
    body = {"model": "", "bogus": 1}
    with secured.client() as c:
        for method, path in routes:
            url = _concrete(path)
            kw = {"json": body} if method in ("POST", "PUT", "PATCH", "DELETE") else {}
            anon = c.request(method, url, **kw)
            if path in ("/health", "/metrics", "/", "/ui/"):  # /, /ui/: the web UI's page
                assert anon.status_code == 200, (method, path, anon.text)
                continue
            if path == "/ui":
                assert anon.status_code == 307  # to /ui/
                continue
            if path.startswith("/ui/static/"):  # the page's files: public, and none by that name
                assert anon.status_code == 404
                continue
            assert anon.status_code == 401, (method, path, anon.status_code)
            assert anon.headers["www-authenticate"] == "Bearer"
            err = anon.json()["error"]
            if path.startswith("/api/"):
                assert isinstance(err, str) and "API key" in err  # Ollama's shape
            elif path.startswith("/v1/messages"):  # Anthropic's shape
                assert anon.json()["type"] == "error"
                assert err["type"] == "authentication_error" and "API key" in err["message"]
            else:
                assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
            wrong = c.request(method, url, headers=_auth("sk-wrong"), **kw)
            assert wrong.status_code == 401, (method, path)
            ok = c.request(method, url, headers=_auth(ALICE), **kw)
            if path in ADMIN_ONLY:  # past the key check, then refused: alice is no admin
                assert ok.status_code in (400, 403), (method, path, ok.text)
                continue
            assert ok.status_code not in (401, 403, 500), (method, path, ok.text)


def test_both_header_styles_and_every_key_source(secured):
    with secured.client() as c:
        assert c.get("/v1/models", headers={"x-api-key": ALICE}).status_code == 200
        assert c.get("/v1/models", headers=_auth(ALICE)).status_code == 200
        assert c.get("/v1/models", headers={"Authorization": f"Basic {ALICE}"}).status_code == 401
        assert c.get("/v1/models", headers={"x-api-key": ALICE[:-1]}).status_code == 401
        for key in ("sk-dave-0123", "sk-erin-0123", "sk-frank-0123"):  # env, file, file
            assert c.get("/api/tags", headers=_auth(key)).status_code == 200, key
        r = c.post(
            "/v1/chat/completions",
            headers=_auth(ALICE),
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_access_log_names_the_key_never_the_secret(secured, caplog):
    def lines():
        return [
            r
            for r in caplog.records
            if r.name == "mlxd.access" and r.fields["request_id"] == "alice-1"
        ]

    with caplog.at_level(logging.INFO, logger="mlxd.access"):
        with secured.client() as c:
            r = c.post(
                "/v1/completions",
                headers={"x-api-key": ALICE, "X-Request-ID": "alice-1"},
                json={"prompt": "hello", "max_tokens": 2},
            )
            assert r.status_code == 200
        deadline = time.time() + 60  # logged when the response is done, maybe a bit later
        while not lines() and time.time() < deadline:
            time.sleep(0.01)
    rec = lines()[0]
    assert rec.fields["key"] == "alice" and rec.fields["model"] == "tiny-llama"
    assert rec.fields["completion_tokens"] == 2 and rec.fields["prompt_tokens"] >= 1
    assert "key=alice" in rec.getMessage()
    assert all(
        ALICE not in r.getMessage() and ALICE not in str(getattr(r, "fields", ""))
        for r in caplog.records
    )


def test_requests_per_minute_gives_429_with_retry_after(secured):
    with secured.client() as c:
        assert c.get("/v1/models", headers=_auth(BOB)).status_code == 200
        assert c.get("/api/tags", headers=_auth(BOB)).status_code == 200
        r = c.get("/v1/models", headers=_auth(BOB))
        assert r.status_code == 429
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
        assert "requests per minute" in err["message"]
        r = c.get("/api/tags", headers=_auth(BOB))
        assert r.status_code == 429 and isinstance(r.json()["error"], str)
        # other keys are not affected; /health is never limited
        assert c.get("/v1/models", headers=_auth(ALICE)).status_code == 200
        assert c.get("/health").status_code == 200


def test_tokens_per_minute_charges_real_usage(secured):
    with secured.client() as c:
        r = c.post(
            "/v1/completions",
            headers=_auth(CAROL),
            json={"prompt": "hello there", "max_tokens": 40},
        )
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] > 30
        r = c.post(
            "/v1/completions", headers=_auth(CAROL), json={"prompt": "again", "max_tokens": 2}
        )
        assert r.status_code == 429
        assert int(r.headers["retry-after"]) >= 2  # >10 tokens over at 0.5 token/s
        assert "tokens per minute" in r.json()["error"]["message"]


def test_body_limit_is_413_in_the_callers_dialect(secured):
    big = {"messages": [{"role": "user", "content": "x" * 5000}], "max_tokens": 2}
    with secured.client() as c:
        r = c.post("/v1/chat/completions", headers=_auth(ALICE), json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = c.post("/api/chat", headers=_auth(ALICE), json={"model": "tiny-llama", **big})
        assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]

        def chunks():  # no Content-Length: counted as it arrives
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"y" * 1000
            yield b'"}'

        r = c.post("/generate", headers=_auth(ALICE), content=chunks())
        assert r.status_code == 413, r.text
        assert "max_body_bytes" in r.json()["error"]["message"]


def _chunked(prefix: bytes, size: int, suffix: bytes):
    """A body sent without Content-Length (chunked), ``size`` filler bytes long."""

    def chunks():
        yield prefix
        for _ in range(size // 1000):
            yield b"y" * 1000
        yield suffix

    return chunks()


def test_a_chunked_body_over_the_limit_is_the_same_413_in_every_dialect(start_server, tiny_llama):
    """Counted as it arrives, a body without Content-Length gets the very answer a declared
    one does: 413, code request_too_large, the setting that limits it named."""
    srv = start_server(
        tiny_llama, security={"max_body_bytes": 4096}, audio={"max_upload_bytes": 1024}
    )
    with srv.client() as c:
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/generate"):
            r = c.post(path, content=_chunked(b'{"prompt": "', 10_000, b'"}'))
            assert r.status_code == 413, (path, r.text)
            err = r.json()["error"]
            assert err["code"] == "request_too_large", (path, err)
            assert "security.max_body_bytes" in err["message"]
        for path in ("/api/chat", "/api/generate"):
            r = c.post(path, content=_chunked(b'{"prompt": "', 10_000, b'"}'))
            assert r.status_code == 413 and set(r.json()) == {"error"}, (path, r.text)
            assert "security.max_body_bytes" in r.json()["error"]
        r = c.post("/v1/messages", content=_chunked(b'{"system": "', 10_000, b'"}'))
        assert r.status_code == 413 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "request_too_large"
        # an upload's limit is audio.max_upload_bytes plus room for the form around it
        boundary = b"mlxdboundary"
        head = (
            b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; '
            b'filename="a.wav"\r\nContent-Type: audio/wav\r\n\r\n'
        )
        r = c.post(
            "/v1/audio/transcriptions",
            headers={"content-type": "multipart/form-data; boundary=mlxdboundary"},
            content=_chunked(head, 400_000, b"\r\n--" + boundary + b"--\r\n"),
        )
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["code"] == "request_too_large" and "audio.max_upload_bytes" in err["message"]
        # the same server still serves a body within the limit
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200, r.text


def test_max_tokens_and_max_inputs_limits_are_400(secured):
    msgs = [{"role": "user", "content": "hi"}]
    with secured.client(headers=_auth(ALICE)) as c:
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 65})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_completion_tokens": 1000})
        assert r.status_code == 400
        r = c.post(
            "/api/generate",
            json={
                "model": "tiny-llama",
                "prompt": "hi",
                "stream": False,
                "options": {"num_predict": 65},
            },
        )
        assert r.status_code == 400 and "max_tokens" in r.json()["error"]
        r = c.post("/generate", json={"prompt": "hi", "max_tokens": 65})
        assert r.status_code == 400
        # -1 ("until the context is full") is capped at the limit instead
        r = c.post(
            "/api/generate",
            json={
                "model": "tiny-llama",
                "prompt": "hi",
                "stream": False,
                "options": {"num_predict": -1},
            },
        )
        assert r.status_code == 200 and r.json()["eval_count"] == 64
        r = c.post("/v1/chat/completions", json={"messages": msgs * 5, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_cors_when_configured(secured):
    origin = {"Origin": "http://ui.example"}
    with secured.client() as c:
        pre = c.options(
            "/v1/chat/completions",
            headers={
                **origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )
        assert pre.status_code == 200  # preflight needs no key
        assert pre.headers["access-control-allow-origin"] == "http://ui.example"
        r = c.get("/v1/models", headers={**origin, **_auth(ALICE)})
        assert r.headers["access-control-allow-origin"] == "http://ui.example"
        assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
        r = c.get("/v1/models", headers=origin)  # refusals are readable by the page too
        assert r.status_code == 401 and "access-control-allow-origin" in r.headers
        r = c.get("/v1/models", headers={"Origin": "http://evil.example", **_auth(ALICE)})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


# -- without a model: the middleware alone (no lifespan) ------------------------------------


def _app(tmp_path, **security_and_metrics):
    from mlxd.api.app import create_app
    from mlxd.config import Settings

    sections = {"models": {"dir": str(tmp_path / "models"), "default": "none"}}
    sections.update(security_and_metrics)
    return create_app(Settings(**sections))


def _client(app):
    """TestClient addressed as localhost (a loopback server refuses its default Host)."""
    from starlette.testclient import TestClient

    return TestClient(app, base_url="http://localhost")


def test_metrics_key_protection_is_a_setting(tmp_path):
    keys = {"api_keys": [{"key": ALICE}]}
    open_ = _client(_app(tmp_path, security=keys))
    assert open_.get("/metrics").status_code == 200
    closed = _client(_app(tmp_path, security=keys, metrics={"require_key": True}))
    assert closed.get("/metrics").status_code == 401
    r = closed.get("/metrics", headers=_auth(ALICE))
    assert r.status_code == 200 and "mlxd:http_requests_total" in r.text
    assert closed.get("/health").status_code != 401


def test_anonymous_limit_without_keys(tmp_path):
    c = _client(_app(tmp_path, security={"anonymous_requests_per_minute": 1}))
    assert c.get("/v1/models").status_code == 200
    r = c.get("/v1/models")
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert c.get("/health").status_code != 429
    assert (
        "access-control-allow-origin"
        not in c.get("/v1/models", headers={"Origin": "http://x.example"}).headers
    )  # CORS off by default


def test_missing_key_file_fails_closed(tmp_path):
    from mlxd.config import ConfigError

    with pytest.raises(ConfigError, match="api_key_file"):
        _app(tmp_path, security={"api_key_file": str(tmp_path / "nope.txt")})


def test_key_file_is_reread_when_it_changes(tmp_path):
    from mlxd.api.security import KeyRing
    from mlxd.config import Settings

    f = tmp_path / "keys"
    f.write_text("ops:sk-one\n")
    ring = KeyRing(Settings(security={"api_key_file": str(f)}), environ={})
    assert ring.match("sk-one").name == "ops" and ring.match("sk-two") is None
    f.write_text("sk-two  # no inline comments: the whole line is the key\nsk-three\n")
    ring._checked = 0.0  # skip the 2 s re-check interval
    assert ring.match("sk-one") is None and ring.match("sk-three").name == "file-2"


def test_open_non_loopback_bind_warns_loudly(caplog):
    from mlxd.api.security import KeyRing, SecurityMiddleware
    from mlxd.config import Settings

    wide = Settings(server={"host": "0.0.0.0"})
    with caplog.at_level(logging.WARNING):
        assert SecurityMiddleware.warn_if_open(wide, KeyRing(wide, environ={}))
    assert "ANYONE" in caplog.text
    keyed = Settings(server={"host": "0.0.0.0"}, security={"api_keys": ["k"]})
    assert not SecurityMiddleware.warn_if_open(keyed, KeyRing(keyed, environ={}))
    local = Settings()
    assert not SecurityMiddleware.warn_if_open(local, KeyRing(local, environ={}))


def test_trust_remote_code_is_off_unless_set(tiny_llama, monkeypatch):
    import pathlib

    import mlxd
    import mlxd.engines.llm as llm
    from mlxd.config import Settings
    from mlxd.engines.registry import create_engine

    src = pathlib.Path(mlxd.__file__).parent
    for f in src.rglob("*.py"):
        text = f.read_text()
        assert "trust_remote_code=True" not in text and '"trust_remote_code": True' not in text, f
    seen = []
    real = llm.mlx_lm_load

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(llm, "mlx_lm_load", spy)
    create_engine("chat", "t", tiny_llama, Settings(engine={"warmup": False}))
    assert seen[-1]["trust_remote_code"] is False
    assert seen[-1]["tokenizer_config"] == {"trust_remote_code": False}
    create_engine(
        "chat",
        "t",
        tiny_llama,
        Settings(engine={"warmup": False}, models={"trust_remote_code": True}),
    )
    assert seen[-1]["trust_remote_code"] is True
