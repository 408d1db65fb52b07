"""/metrics (Prometheus text), the access log and request ids, through real HTTP."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest
from conftest import LiveServer, make_settings
from prometheus_client.parser import text_string_to_metric_families


@pytest.fixture(scope="module")
def srv(tmp_path_factory, long_llama):
    # long-llama: slow enough that a client can leave mid-generation
    s = LiveServer(make_settings(tmp_path_factory.mktemp("met"), long_llama)).start()
    yield s
    s.stop()


def scrape(srv) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} from GET /metrics, parsed by prometheus-client."""
    r = httpx.get(srv.url + "/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_counters_move_after_traffic(srv):
    m = "long-llama"
    before = scrape(srv)
    with srv.client() as c:
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5},
        )
        assert r.status_code == 200
        prompt = r.json()["usage"]["prompt_tokens"]
        with c.stream(
            "POST", "/v1/completions", json={"prompt": "once", "max_tokens": 4, "stream": True}
        ) as s:
            assert s.status_code == 200 and "data: [DONE]" in list(s.iter_lines())
        r = c.post(
            "/api/generate",
            json={"model": m, "prompt": "hi", "stream": False, "options": {"num_predict": 3}},
        )
        assert r.status_code == 200
        r = c.post("/v1/chat/completions", json={"messages": [], "max_tokens": 5})
        assert r.status_code == 400
        assert c.get("/v1/models/some-model").status_code == 404
        assert c.get("/no/such/path").status_code == 404
    after = scrape(srv)

    d = lambda name, **kw: delta(before, after, name, **kw)  # noqa: E731
    assert d("mlxd:time_to_first_token_seconds_count", model=m) == 3
    assert d("mlxd:e2e_request_latency_seconds_count", model=m) == 3
    assert d("mlxd:request_queue_time_seconds_count", model=m) == 3
    assert d("mlxd:inter_token_latency_seconds_count", model=m) == (5 - 1) + (4 - 1) + (3 - 1)
    assert d("mlxd:generation_tokens_total", model=m) == 5 + 4 + 3
    assert d("mlxd:prompt_tokens_total", model=m) >= prompt + 2
    assert d("mlxd:request_success_total", model=m, finished_reason="length") == 3
    assert after[("mlxd:num_requests_running", (("model", m),))] == 0
    assert after[("mlxd:num_requests_waiting", (("model", m),))] == 0
    # HTTP by route template and status, never by raw path
    assert (
        d("mlxd:http_requests_total", method="POST", route="/v1/chat/completions", status="200")
        == 1
    )
    assert (
        d("mlxd:http_requests_total", method="POST", route="/v1/chat/completions", status="400")
        == 1
    )
    assert (
        d(
            "mlxd:http_requests_total",
            method="GET",
            route="/v1/models/{model_id:path}",
            status="404",
        )
        == 1
    )
    assert d("mlxd:http_requests_total", method="GET", route="unmatched", status="404") == 1
    assert not any("some-model" in str(k) or "/no/such" in str(k) for k in after)
    assert d("mlxd:http_request_duration_seconds_count", method="POST", route="/api/generate") == 1
    # the model cache
    assert after[("mlxd:models_loaded", (("kind", "chat"),))] >= 1
    assert after[("mlxd:model_memory_bytes", (("model", m),))] > 0
    assert after[("mlxd:model_load_seconds_count", (("model", m),))] >= 1


def test_a_client_that_leaves_counts_as_cancelled(srv):
    m = "long-llama"
    before = scrape(srv)
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        with c.stream(
            "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 4000, "stream": True}
        ) as s:
            next(s.iter_lines())
    deadline = time.time() + 10
    while time.time() < deadline:
        after = scrape(srv)
        if (
            delta(before, after, "mlxd:request_success_total", model=m, finished_reason="cancelled")
            == 1
        ):
            break
        time.sleep(0.05)
    else:
        raise AssertionError("no cancelled request counted")
    assert after[("mlxd:num_requests_running", (("model", m),))] == 0


def test_request_id_round_trips_and_the_access_log_has_the_facts(srv, caplog):
    with caplog.at_level(logging.INFO, logger="mlxd.access"):
        r = httpx.post(
            srv.url + "/generate",
            json={"prompt": "hi", "max_tokens": 2},
            headers={"X-Request-ID": "req-42"},
            timeout=30,
        )
        assert r.status_code == 200 and r.headers["x-request-id"] == "req-42"
        r = httpx.get(srv.url + "/v1/models", timeout=10)
        generated = r.headers["x-request-id"]
        assert len(generated) == 32

        def access_log() -> dict:
            return {
                rec.fields["request_id"]: rec for rec in caplog.records if rec.name == "mlxd.access"
            }

        # the line is written when the response is done, maybe just after the client has it
        deadline = time.time() + 60
        while not {"req-42", generated} <= set(access_log()) and time.time() < deadline:
            time.sleep(0.01)
        recs = access_log()
    rec = recs["req-42"]
    assert rec.fields["route"] == "/generate" and rec.fields["status"] == 200
    assert rec.fields["model"] == "long-llama"
    assert rec.fields["completion_tokens"] == 2 and rec.fields["prompt_tokens"] >= 1
    assert rec.fields["duration_ms"] > 0 and "key" not in rec.fields
    assert "rid=req-42" in rec.getMessage() and "tokens=" in rec.getMessage()
    assert recs[generated].fields["route"] == "/v1/models"

    from mlxd.observability.logs import JsonFormatter

    line = json.loads(JsonFormatter().format(rec))
    assert line["logger"] == "mlxd.access" and line["request_id"] == "req-42"
    assert line["model"] == "long-llama" and line["completion_tokens"] == 2
    assert line["status"] == 200 and line["route"] == "/generate"


def test_no_cors_headers_by_default(srv):
    r = httpx.get(srv.url + "/v1/models", headers={"Origin": "http://ui.example"})
    assert "access-control-allow-origin" not in r.headers
