"""What a client sends cannot forge a log line: a newline (or any control character) in a
logged field is escaped in the text log, quoted when it could pass for another field, and
kept one line in the JSON log with its value intact."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest

from mlxd.observability.logs import JsonFormatter, TextFormatter

TEXT = TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
FORGED = "alice\n2026-01-01 00:00:00,000 INFO mlxd.access: POST /admin 200 0.1ms rid=x"


def _record(caplog, rid: str) -> logging.LogRecord:
    # the line is written when the response is done, maybe just after the client has it
    deadline = time.time() + 60
    while time.time() < deadline:
        for rec in caplog.records:
            if rec.name == "mlxd.access" and rec.fields["request_id"] == rid:
                return rec
        time.sleep(0.01)
    raise AssertionError(f"no access log line for {rid}")


@pytest.fixture()
def access_log(caplog):
    with caplog.at_level(logging.INFO, logger="mlxd.access"):
        yield lambda rid: _record(caplog, rid)


def test_a_newline_in_user_does_not_forge_a_line(server, access_log):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=60,
        headers={"X-Request-ID": "forge-user"},
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "user": FORGED},
    )
    assert r.status_code == 200, r.text
    rec = access_log("forge-user")
    text = TEXT.format(rec)
    assert len(text.splitlines()) == 1
    assert 'user="alice\\n2026-01-01 00:00:00,000 INFO mlxd.access: POST /admin' in text
    line = JsonFormatter().format(rec)
    assert len(line.splitlines()) == 1 and json.loads(line)["user"] == FORGED


def test_a_control_character_in_the_path_is_escaped(server, access_log):
    r = httpx.get(
        server.url + "/v1/models/x%0D%0AINFO%20forged%1B[31m%E2%80%A8",
        headers={"X-Request-ID": "forge-path"},
        timeout=10,
    )
    assert r.status_code == 404
    rec = access_log("forge-path")
    text = TEXT.format(rec)
    assert len(text.splitlines()) == 1 and "\x1b" not in text
    assert '"/v1/models/x\\r\\nINFO forged\\x1b[31m\\u2028"' in text
    line = JsonFormatter().format(rec)
    assert len(line.splitlines()) == 1
    assert json.loads(line)["path"] == "/v1/models/x\r\nINFO forged\x1b[31m\u2028"


def test_a_value_cannot_pass_for_another_field(server, access_log):
    r = httpx.post(
        server.url + "/v1/completions",
        timeout=60,
        headers={"X-Request-ID": "forge-field"},
        json={"prompt": "hi", "max_tokens": 1, "user": 'bob status=500 "x"'},
    )
    assert r.status_code == 200, r.text
    msg = access_log("forge-field").getMessage()
    assert 'user="bob status=500 \\"x\\""' in msg
    assert msg.split(" ")[2] == "200"  # the real status, where the text format puts it
