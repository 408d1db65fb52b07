"""Rate limits shared through a real redis-server: two live mlxd servers enforce one limit,
atomically, in the caller's dialect; an unreachable Redis follows
``security.rate_limit_store_failure`` (open: local limits + metric; closed: 503)."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import LiveServer, free_port, make_settings

BOB, CAROL, DAVE, ERIN = (
    "sk-bob-redis-0123",
    "sk-carol-redis-0123",
    "sk-dave-redis-0123",
    "sk-erin-redis-0123",
)
KEYS = [
    {"key": BOB, "name": "bob", "requests_per_minute": 3},
    {"key": CAROL, "name": "carol", "tokens_per_minute": 30},
    {"key": DAVE, "name": "dave", "requests_per_minute": 10},
    {"key": ERIN, "name": "erin"},  # no limit
]

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None and not os.environ.get("CI"),
    reason="redis-server missing (.ci/run installs Debian's redis-server; on CI its absence "
    "fails these tests)",
)


class RedisServer:
    """A private redis-server on a free port, no persistence, in a temp dir."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = self.client()
        deadline = time.time() + 15
        while True:
            try:
                client.ping()
                return self
            except Exception:  # noqa: BLE001 - not up yet
                if time.time() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def _no_buckets(request) -> None:
    """Each test that uses the shared Redis starts with no buckets: no other test's counts
    or TTLs in its way, whatever ran before it."""
    if "redis_server" in request.fixturenames:
        request.getfixturevalue("redis_server").client().flushdb()


def _replica(home: Path, model: Path, **security) -> LiveServer:
    settings = make_settings(home, model, security={"api_keys": KEYS, **security})
    return LiveServer(settings).start()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, tiny_llama, redis_server):
    home = tmp_path_factory.mktemp("replicas")
    # a generous timeout: a loaded test machine must not look like a Redis outage here
    a = _replica(home, tiny_llama, rate_limit_store=redis_server.url, rate_limit_store_timeout_s=5)
    b = _replica(home, tiny_llama, rate_limit_store=redis_server.url, rate_limit_store_timeout_s=5)
    yield a, b
    a.stop()
    b.stop()


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_two_servers_share_one_request_limit(replicas, redis_server):
    a, b = replicas
    assert [httpx.get(s.url + "/v1/models", headers=_auth(BOB)).status_code for s in (a, b, a)] == [
        200,
        200,
        200,
    ]
    r = httpx.get(b.url + "/v1/models", headers=_auth(BOB))  # B never saw 3 requests itself
    assert r.status_code == 429
    assert int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
    assert "requests per minute" in err["message"] and "'bob'" in err["message"]
    r = httpx.get(a.url + "/api/tags", headers=_auth(BOB))  # Ollama's dialect
    assert r.status_code == 429 and isinstance(r.json()["error"], str)
    assert r.headers["retry-after"]
    r = httpx.post(
        a.url + "/v1/messages",
        headers=_auth(BOB),  # Anthropic's
        json={
            "model": "tiny-llama",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    # other keys and /health are not affected
    assert httpx.get(b.url + "/v1/models", headers=_auth(ERIN)).status_code == 200
    assert httpx.get(b.url + "/health").status_code == 200
    # the buckets in Redis: named by digest (never the key), with a TTL (idle keys vanish)
    rc = redis_server.client()
    names = [k.decode() for k in rc.keys("mlxd:ratelimit:*")]
    assert names and all(BOB not in n and "bob" not in n for n in names)
    assert all(0 < rc.pttl(n) <= 61_000 for n in names)


def test_the_shared_check_is_atomic_under_concurrency(replicas):
    """30 requests at once, split over both servers, for a key allowed 10 a minute: exactly
    10 pass (11 if a refill lands during the burst), not 10 per server."""
    a, b = replicas

    def one(i: int) -> int:
        srv = (a, b)[i % 2]
        return httpx.get(srv.url + "/v1/models", headers=_auth(DAVE), timeout=30).status_code

    fallbacks = _errors_metric(a, "open")  # one registry: both servers run in this process
    with ThreadPoolExecutor(12) as pool:
        codes = list(pool.map(one, range(30)))
    assert _errors_metric(a, "open") == fallbacks, "a check fell back to local buckets"
    assert set(codes) == {200, 429}
    assert 10 <= codes.count(200) <= 11, codes


def test_tokens_used_on_one_server_hold_back_the_other(replicas):
    a, b = replicas
    r = httpx.post(
        a.url + "/v1/completions",
        headers=_auth(CAROL),
        timeout=60,
        json={"model": "tiny-llama", "prompt": "hello there", "max_tokens": 40},
    )
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] > 30
    r = httpx.post(
        b.url + "/v1/completions",
        headers=_auth(CAROL),
        timeout=60,
        json={"model": "tiny-llama", "prompt": "again", "max_tokens": 2},
    )
    assert r.status_code == 429
    assert int(r.headers["retry-after"]) >= 2  # >10 tokens over at 0.5 token/s
    assert "tokens per minute" in r.json()["error"]["message"]


def test_api_workers_front_ends_share_one_limit(tmp_path, tiny_llama, redis_server):
    """`mlxd serve --api-workers 2` with no keys and an anonymous limit of 4 a minute: the two
    front-end processes each have their own store client but one set of buckets, so 4 of 12
    requests pass (in memory each front end would allow 4)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(
        os.environ,
        MLXD_HOME=str(tmp_path / "home"),
        HF_HUB_OFFLINE="1",
        MLXD_SECURITY__ANONYMOUS_REQUESTS_PER_MINUTE="4",
        MLXD_SECURITY__RATE_LIMIT_STORE=redis_server.url.replace("/0", "/1"),
    )
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlxd",
            "serve",
            "--model",
            str(tiny_llama),
            "--port",
            str(port),
            "--api-workers",
            "2",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        frontends: set[int] = set()
        deadline = time.time() + 120
        while len(frontends) < 2 and time.time() < deadline:
            assert p.poll() is None, "mlxd serve exited"
            try:
                with httpx.Client(timeout=10) as c:  # a new connection: any worker
                    h = c.get(url + "/health")
                if h.status_code == 200:
                    frontends.add(h.json()["frontend_pid"])
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        assert len(frontends) == 2
        codes = []
        for _ in range(12):
            with httpx.Client(timeout=30) as c:
                codes.append(c.get(url + "/v1/models").status_code)
        assert codes.count(200) == 4 and codes.count(429) == 8, codes
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(60)


def _errors_metric(srv: LiveServer, policy: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(srv.url + "/metrics").text
    for fam in text_string_to_metric_families(text):
        if fam.name == "mlxd:rate_limit_store_errors":
            for s in fam.samples:
                if s.name.endswith("_total") and s.labels.get("policy") == policy:
                    return s.value
    return 0.0


def test_unreachable_redis_fails_open_to_local_limits(tmp_path, tiny_llama, caplog):
    dead = f"redis://:s3cret-pw@127.0.0.1:{free_port()}/0"  # nothing listens there
    with caplog.at_level(logging.WARNING, logger="mlxd.api.ratelimit"):
        srv = _replica(tmp_path, tiny_llama, rate_limit_store=dead)
        try:
            before = _errors_metric(srv, "open")
            codes = [
                httpx.get(srv.url + "/v1/models", headers=_auth(BOB)).status_code for _ in range(4)
            ]
            # served, and still limited: by this process's own buckets
            assert codes == [200, 200, 200, 429]
            assert _errors_metric(srv, "open") >= before + 1
        finally:
            srv.stop()
    msgs = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(msgs) == 1 and "security.rate_limit_store_failure=open" in msgs[0]
    assert "s3cret-pw" not in msgs[0] and ":***@127.0.0.1" in msgs[0]  # no password in logs


def test_fail_closed_gives_503_until_redis_is_back(tmp_path, tiny_llama):
    redis = RedisServer(tmp_path).start()
    srv = _replica(
        tmp_path, tiny_llama, rate_limit_store=redis.url, rate_limit_store_failure="closed"
    )
    try:
        assert httpx.get(srv.url + "/v1/models", headers=_auth(BOB)).status_code == 200
        redis.stop()
        r = httpx.get(srv.url + "/v1/models", headers=_auth(BOB))
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "rate_limit_store_unavailable"
        r = httpx.get(srv.url + "/api/tags", headers=_auth(BOB))
        assert r.status_code == 503 and "rate-limit store" in r.json()["error"]
        # a key without limits needs no store; /health tells nothing false
        assert httpx.get(srv.url + "/v1/models", headers=_auth(ERIN)).status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200
        assert _errors_metric(srv, "closed") >= 2
        redis.start()  # same port: after the back-off the shared limit is back
        deadline = time.time() + 10
        while True:
            code = httpx.get(srv.url + "/v1/models", headers=_auth(BOB)).status_code
            if code == 200 or time.time() > deadline:
                break
            time.sleep(0.3)
        assert code == 200
        assert redis.client().keys("mlxd:ratelimit:*")
    finally:
        srv.stop()
        redis.stop()


def test_store_setting_is_validated(tmp_path):
    from mlxd.config import Settings

    with pytest.raises(ValueError, match="Redis URL"):
        Settings(security={"rate_limit_store": "memcached://x:11211"})
    assert (
        Settings(security={"rate_limit_store": "rediss://h:6380/1"}).security.rate_limit_store
        == "rediss://h:6380/1"
    )


def test_lua_buckets_refill_expire_and_go_negative(redis_server):
    """The script's arithmetic, against the real Redis: the same as the in-memory buckets."""
    import asyncio

    from mlxd.api.ratelimit import MemoryLimits, RedisLimits

    async def run() -> None:
        store = RedisLimits(redis_server.url, "closed", 1.0)
        mem = MemoryLimits()
        try:
            for lim in (store, mem):
                # 120 a minute: 120 at once, then one more every half second
                assert [await lim.admit(f"refill-{id(lim)}", 120, None) for _ in range(120)] == [
                    (0.0, "")
                ] * 120
                wait, which = await lim.admit(f"refill-{id(lim)}", 120, None)
                assert which == "requests per minute" and 0 < wait <= 0.5
                await asyncio.sleep(wait + 0.05)
                assert await lim.admit(f"refill-{id(lim)}", 120, None) == (0.0, "")
                # post-paid tokens: 100 a minute, 160 used -> 60 below zero, 36s to wait
                assert await lim.admit(f"tok-{id(lim)}", None, 100) == (0.0, "")
                await lim.charge(f"tok-{id(lim)}", None, 100, 160)
                wait, which = await lim.admit(f"tok-{id(lim)}", None, 100)
                assert which == "tokens per minute" and 33 < wait <= 36.0
            rc = redis_server.client()
            key = f"mlxd:ratelimit:{{tok-{id(store)}}}:tokens"
            # the key lives until the bucket would be full again: 160 tokens at 100/min
            assert 94_000 < rc.pttl(key) <= 97_000
            assert float(rc.hget(key, "level")) == pytest.approx(-60, abs=0.1)
        finally:
            await store.aclose()

    asyncio.run(run())
