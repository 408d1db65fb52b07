"""The cheap part of the attack campaign (docs/security.md), on every run.

Each hostile input goes to the chat route of every dialect that can carry it, and every
answer must be a 4xx in that route's own error shape: never a 5xx, never a success that ran
what it should not. The server must still serve an ordinary request afterwards. The long
campaign, with process kills and drains under load, is benchmarks/attack_campaign.py; the
per-feature regressions live beside their features (test_ops_origins.py, test_owners.py,
tests/api/test_template_safety.py, test_structured.py, test_tools.py).
"""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import LiveServer, make_settings

USER = {"role": "user", "content": "hi"}
BAD_SCHEMAS = [
    {"$ref": "#"},
    {"type": "object", "properties": {"a": {"$ref": "#/definitions/nowhere"}}},
    {"type": "string", "pattern": "(((a+)+)+)+$("},
    {"type": "object", "properties": {"a": {"type": "strin"}}, "required": ["a"]},
]
BAD_TOOL_CALLS = [
    "x",
    [{"id": "a", "type": "function", "function": "notadict"}],
    [{"id": "a", "type": "function", "function": {"arguments": "{}"}}],
    [{"id": "a", "type": "function", "function": {"name": "f", "arguments": 5}}],
    [{"id": "a", "type": "function", "function": {"name": ["f"], "arguments": "{}"}}],
    [None],
]
DEEP = 100_000  # nesting that a recursive JSON decoder cannot follow


def _openai(extra: dict) -> dict:
    return {"model": "tiny-llama", "messages": [USER], "max_tokens": 4, **extra}


def _ollama(extra: dict) -> dict:
    return {
        "model": "tiny-llama",
        "messages": [USER],
        "stream": False,
        "options": {"num_predict": 4},
        **extra,
    }


def _ollama_options(extra: dict) -> dict:
    """Ollama's sampling fields live in ``options``."""
    return _ollama({"options": {"num_predict": 4, **extra}})


def _anthropic(extra: dict) -> dict:
    return {"model": "tiny-llama", "messages": [USER], "max_tokens": 4, **extra}


def _responses(extra: dict) -> dict:
    return {"model": "tiny-llama", "input": "hi", "max_output_tokens": 4, **extra}


def cases() -> list[tuple[str, str, dict | bytes]]:
    """(what, path, body) of every hostile request the sweep sends."""
    out: list[tuple[str, str, dict | bytes]] = []
    for i, schema in enumerate(BAD_SCHEMAS):
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        out += [
            (f"schema{i}", "/v1/chat/completions", _openai({"response_format": fmt})),
            (f"schema{i}", "/api/chat", _ollama({"format": schema})),
            (
                f"schema{i}",
                "/v1/responses",
                _responses(
                    {"text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}
                ),
            ),
            (
                f"schema{i}",
                "/v1/messages",
                _anthropic(
                    {"output_config": {"format": {"type": "json_schema", "schema": schema}}}
                ),
            ),
        ]
    for i, calls in enumerate(BAD_TOOL_CALLS):
        msgs = [USER, {"role": "assistant", "content": "", "tool_calls": calls}, USER]
        out += [
            (f"tool_calls{i}", "/v1/chat/completions", _openai({"messages": msgs})),
            (f"tool_calls{i}", "/api/chat", _ollama({"messages": msgs})),
        ]
    out += [
        (
            "tool_use input",
            "/v1/messages",
            _anthropic(
                {
                    "messages": [
                        USER,
                        {
                            "role": "assistant",
                            "content": [
                                {"type": "tool_use", "id": "a", "name": "f", "input": "notadict"}
                            ],
                        },
                        USER,
                    ]
                }
            ),
        ),
        (
            "function_call item",
            "/v1/responses",
            _responses(
                {"input": [{"type": "function_call", "call_id": "a", "name": 5, "arguments": "{}"}]}
            ),
        ),
    ]
    for key in (
        "chat_template",
        "messages",
        "tools",
        "add_generation_prompt",
        "tokenize",
        "raise_exception",
        "_private",
        "not an identifier",
    ):
        out.append(
            (
                f"template {key}",
                "/v1/chat/completions",
                _openai({"chat_template_kwargs": {key: "{{ 7 * 7 }}"}}),
            )
        )
    for path, build in (
        ("/v1/chat/completions", _openai),
        ("/api/chat", _ollama_options),
        ("/v1/messages", _anthropic),
        ("/v1/responses", _responses),
    ):
        out += [
            ("blank model", path, {**build({}), "model": "  "}),
            ("deep json", path, b'{"messages": ' + b"[" * DEEP + b"]" * DEEP + b"}"),
            ("not json", path, b"\xff\xfe{"),
            (
                "infinite temperature",
                path,
                json.dumps(build({"temperature": "INF"})).replace('"INF"', "1e999").encode(),
            ),
            (
                "NaN top_p",
                path,
                json.dumps(build({"top_p": "NAN"})).replace('"NAN"', "NaN").encode(),
            ),
        ]
    return out


def _error_shape(path: str, body: object) -> bool:
    """The dialect's own error object."""
    if not isinstance(body, dict):
        return False
    if path.startswith("/api/"):
        return isinstance(body.get("error"), str) and bool(body["error"])
    if path == "/v1/messages":
        err = body.get("error")
        return body.get("type") == "error" and isinstance(err, dict) and bool(err.get("message"))
    err = body.get("error")
    return isinstance(err, dict) and bool(err.get("message")) and "type" in err


@pytest.fixture(scope="module")
def srv(tmp_path_factory, tiny_llama):
    home = tmp_path_factory.mktemp("campaign")
    s = LiveServer(make_settings(home, tiny_llama, server={"template_timeout_s": 5})).start()
    yield s
    s.stop()


def test_every_hostile_input_is_a_4xx_in_its_dialect(srv):
    wrong = []
    with srv.client(timeout=120) as c:
        for what, path, body in cases():
            if isinstance(body, bytes):
                r = c.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = c.post(path, json=body)
            try:
                parsed = r.json()
            except ValueError:
                parsed = r.text
            if not (400 <= r.status_code < 500 and _error_shape(path, parsed)):
                wrong.append((what, path, r.status_code, str(parsed)[:160]))
        assert not wrong, "\n".join(map(str, wrong))
        r = c.post("/v1/chat/completions", json=_openai({}))
        assert r.status_code == 200, r.text
    assert srv.health()["status"] == "ok"


def test_a_hostile_stream_ends_with_an_error_event_not_a_stop(srv):
    """A grammar that fails while generating, streamed: an error event, never a 'stop'."""
    body = _openai(
        {
            "stream": True,
            "max_tokens": 16,
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {
                        "type": "object",
                        "properties": {"a": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
                        "required": ["a"],
                    },
                },
            },
        }
    )
    with srv.client(timeout=120) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code == 400:  # refused before it ran: as good
            return
        assert r.status_code == 200
        events = [
            json.loads(line[6:])
            for line in r.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]
    finishes = [ch.get("finish_reason") for e in events for ch in e.get("choices", [])]
    assert "stop" not in finishes
    assert any("error" in e for e in events) or "length" in finishes, events[-3:]


def test_hostile_requests_leave_nothing_running(srv):
    """After the sweep, nothing hostile is still queued or rendering on the server."""
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        h = c.get("/health").json()
    assert h["status"] == "ok"
    core = h.get("engine_core", {})
    assert core.get("requests_in_flight", 0) == 0, core
