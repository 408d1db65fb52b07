"""OpenTelemetry traces from `mlxd serve` to a real OTLP/HTTP receiver: the request span
(front end) under the client's traceparent, the engine core's queue/prefill/decode spans
under it; and with no endpoint, nothing of the SDK loaded in any process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from conftest import free_port, wait_healthy, wait_until
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as trace_pb2

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


# what the front end's and the core's conversions of the time to the epoch may differ by
SKEW_NS = 10_000_000


class Receiver:
    """An OTLP/HTTP trace receiver: POST /v1/traces, protobuf bodies, every span kept."""

    def __init__(self) -> None:
        self.spans: list = []
        self.paths: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.paths.append(self.path)
                req = trace_pb2.ExportTraceServiceRequest()
                req.ParseFromString(body)
                for rs in req.resource_spans:
                    for ss in rs.scope_spans:
                        outer.spans.extend(ss.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def named(self, name: str) -> list:
        return [s for s in list(self.spans) if s.name == name]


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()
    r.server.server_close()


def _attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        if kind == "array_value":
            out[kv.key] = [getattr(x, x.WhichOneof("value")) for x in v.array_value.values]
        else:
            out[kv.key] = getattr(v, kind)
    return out


def _serve(model, port: int, env: dict, log: Path, *extra: str) -> subprocess.Popen:
    """`mlxd serve`, its output to ``log`` (a file: a pipe nobody reads would fill and
    block it)."""
    with log.open("w") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlxd",
                "serve",
                "--model",
                str(model),
                "--port",
                str(port),
                *extra,
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["HF_HUB_OFFLINE"] = "1"
    return env


def _stop(p: subprocess.Popen, log: Path) -> str:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
    p.wait(timeout=60)
    return log.read_text(errors="replace")


def _chat(url: str, headers: dict | None = None) -> dict:
    r = httpx.post(
        url + "/v1/chat/completions",
        headers=headers or {},
        json={
            "model": "default",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": 0.5,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_request_and_core_spans_reach_the_collector(tmp_path, tiny_llama, receiver) -> None:
    port = free_port()
    env = _env()
    env["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # export within 0.1 s, not the default 5 s
    log = tmp_path / "serve.log"
    p = _serve(tiny_llama, port, env, log, "--otlp-traces-endpoint", receiver.url)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, p, 180, lambda: _stop(p, log))
        body = _chat(url, {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})

        def complete() -> bool:
            return bool(receiver.named("chat tiny-llama")) and all(
                receiver.named(n) for n in ("queue", "prefill", "decode")
            )

        assert wait_until(complete, timeout=60), [s.name for s in receiver.spans]
    finally:
        out = _stop(p, log)
    assert set(receiver.paths) == {"/v1/traces"}, out
    (req,) = receiver.named("chat tiny-llama")
    assert req.trace_id.hex() == TRACE_ID
    assert req.parent_span_id.hex() == PARENT_ID
    assert req.kind == req.SPAN_KIND_SERVER
    a = _attrs(req)
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == "tiny-llama"
    assert a["gen_ai.request.max_tokens"] == 4
    assert a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.response.id"] == body["id"]
    assert a["gen_ai.response.finish_reasons"] == [body["choices"][0]["finish_reason"]]
    assert a["gen_ai.usage.input_tokens"] == body["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"]
    assert a["mlxd.time_to_first_token_s"] > 0
    assert a["mlxd.queue_time_s"] >= 0
    assert a["http.response.status_code"] == 200
    phases = [receiver.named(n)[0] for n in ("queue", "prefill", "decode")]
    for span in phases:
        assert span.trace_id.hex() == TRACE_ID
        assert span.parent_span_id == req.span_id
        # two processes' readings of the time: each converts its own clock to the epoch
        assert req.start_time_unix_nano - SKEW_NS <= span.start_time_unix_nano
        assert span.start_time_unix_nano <= span.end_time_unix_nano
        assert span.end_time_unix_nano <= req.end_time_unix_nano + SKEW_NS
    queue, prefill, decode = phases
    assert queue.end_time_unix_nano <= prefill.start_time_unix_nano
    assert prefill.end_time_unix_nano <= decode.start_time_unix_nano
    assert _attrs(decode)["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"]


def test_no_endpoint_no_sdk_loaded(tmp_path, tiny_llama) -> None:
    """Python's import log (-X importtime, which the engine core inherits through the
    environment) of a server that answered a chat request names no OpenTelemetry SDK."""
    port = free_port()
    env = _env()
    env["PYTHONPROFILEIMPORTTIME"] = "1"
    log = tmp_path / "serve.log"
    p = _serve(tiny_llama, port, env, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, p, 300, lambda: _stop(p, log)[-3000:])
        _chat(url, {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    finally:
        out = _stop(p, log)
    # both processes listed: the front end's app, and MLX, which only the engine core imports
    assert re.search(r"\|\s+mlxd\.api\.app$", out, re.M), out[-3000:]
    assert re.search(r"\|\s+mlx\.core$", out, re.M), out[-3000:]
    assert "opentelemetry.sdk" not in out
    assert "opentelemetry.exporter" not in out
