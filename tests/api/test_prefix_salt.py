"""Who shares the prefix cache, through HTTP: a request's ``cache_salt`` (vLLM's field) and
``security.prefix_cache_isolation``. A prefix cached under one salt or API key never
shows in another's ``cached_tokens`` (nor its ``cache_read_input_tokens``), in memory or
on disk after a restart; greedy output is the same whether a request hit or not."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest
from conftest import LiveServer, make_settings

ALICE, BOB = "sk-salt-alice-01", "sk-salt-bob-01"
KEYS = {"api_keys": [{"key": ALICE, "name": "alice"}, {"key": BOB, "name": "bob"}]}
SMALL = {"prefix_cache_min_tokens": 0, "warmup": False}


def _messages() -> list[dict]:
    """A long prompt no other test sent (the session's servers are shared)."""
    tag = uuid.uuid4().hex[:8]
    return [
        {"role": "system", "content": f"Agent {tag}. Follow the tool rules exactly. " * 14},
        {"role": "user", "content": "List the files, please."},
    ]


def _chat(srv, messages, key: str = "x", **extra) -> tuple[str, int, int]:
    """(text, prompt tokens, cached tokens) of a greedy OpenAI chat completion."""
    model = Path(srv.settings.models.default).name
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        timeout=120,
        headers={"Authorization": f"Bearer {key}"},
        json={"model": model, "messages": messages, "temperature": 0, "max_tokens": 8, **extra},
    )
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    return (
        r.json()["choices"][0]["message"]["content"],
        u["prompt_tokens"],
        u["prompt_tokens_details"]["cached_tokens"],
    )


def test_equal_salts_share_and_other_salts_do_not(agent_server):
    msgs = _messages()
    text, prompt, cached = _chat(agent_server, msgs, cache_salt="tenant-a")
    assert cached == 0
    again = _chat(agent_server, msgs, cache_salt="tenant-a")
    assert again == (text, prompt, prompt - 1)  # all but the last prompt token
    assert _chat(agent_server, msgs, cache_salt="tenant-b") == (text, prompt, 0)
    assert _chat(agent_server, msgs) == (text, prompt, 0)  # no salt: another partition
    assert _chat(agent_server, msgs)[2] == prompt - 1
    assert _chat(agent_server, msgs, cache_salt="tenant-b")[2] == prompt - 1


def test_cache_salt_in_completions_responses_anthropic_and_ollama(agent_server):
    url = agent_server.url
    with httpx.Client(base_url=url, timeout=120) as c:
        prompt = _messages()[0]["content"]
        first = None
        for salt, want_hit in (("c", False), ("c", True), ("d", False)):
            r = c.post(
                "/v1/completions",
                json={
                    "model": "tool-qwen2",
                    "prompt": prompt,
                    "max_tokens": 6,
                    "temperature": 0,
                    "cache_salt": salt,
                },
            )
            assert r.status_code == 200, r.text
            first = first or r.json()["choices"][0]["text"]
            assert r.json()["choices"][0]["text"] == first
            assert (r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0) is want_hit

        text = _messages()[0]["content"]
        for salt, want_hit in (("e", False), ("e", True), ("f", False)):
            r = c.post(
                "/v1/responses",
                json={
                    "model": "tool-qwen2",
                    "input": text,
                    "max_output_tokens": 6,
                    "temperature": 0,
                    "store": False,
                    "cache_salt": salt,
                },
            )
            assert r.status_code == 200, r.text
            cached = r.json()["usage"]["input_tokens_details"]["cached_tokens"]
            assert (cached > 0) is want_hit

        system = _messages()[0]["content"]
        for salt, want_hit in (("g", False), ("g", True), ("h", False)):
            r = c.post(
                "/v1/messages",
                json={
                    "model": "tool-qwen2",
                    "max_tokens": 6,
                    "temperature": 0,
                    "system": system,
                    "messages": [{"role": "user", "content": "Hello."}],
                    "cache_salt": salt,
                },
            )
            assert r.status_code == 200, r.text
            assert (r.json()["usage"]["cache_read_input_tokens"] > 0) is want_hit

        # Ollama reports no cached tokens: what its request left is found by an OpenAI one
        msgs = _messages()
        r = c.post(
            "/api/chat",
            json={
                "model": "tool-qwen2",
                "messages": msgs,
                "stream": False,
                "cache_salt": "i",
                "options": {"temperature": 0, "num_predict": 4},
            },
        )
        assert r.status_code == 200, r.text
    assert _chat(agent_server, msgs, cache_salt="j")[2] == 0
    assert _chat(agent_server, msgs, cache_salt="i")[2] > 0


@pytest.mark.parametrize(
    ("path", "body", "shape"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "openai"),
        (
            "/v1/messages",
            {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
            "anthropic",
        ),
        ("/api/generate", {"prompt": "hi"}, "ollama"),
    ],
)
@pytest.mark.parametrize("salt", ["", 7, "s" * 1025])
def test_a_bad_cache_salt_is_a_400_in_the_callers_dialect(agent_server, path, body, shape, salt):
    r = httpx.post(
        agent_server.url + path,
        timeout=60,
        json={"model": "tool-qwen2", **body, "cache_salt": salt},
    )
    assert r.status_code == 400, r.text
    err = r.json()
    if shape == "openai":
        assert err["error"]["param"] == "cache_salt"
    elif shape == "anthropic":
        assert err["type"] == "error" and "cache_salt" in err["error"]["message"]
    else:
        assert "cache_salt" in err["error"]


def test_per_key_isolation_is_the_default_with_keys(start_server, tool_qwen2):
    srv = start_server(tool_qwen2, engine=SMALL, security=KEYS)
    assert srv.settings.security.prefix_cache_isolation == "per_key"
    msgs = _messages()
    text, prompt, cached = _chat(srv, msgs, ALICE)
    assert cached == 0
    assert _chat(srv, msgs, ALICE) == (text, prompt, prompt - 1)  # alice's repeat hits
    assert _chat(srv, msgs, BOB) == (text, prompt, 0)  # bob learns nothing of it
    assert _chat(srv, msgs, BOB)[2] == prompt - 1  # his own repeat hits
    # a cache_salt narrows a key's partition, and never reaches another key's
    assert _chat(srv, msgs, ALICE, cache_salt="x") == (text, prompt, 0)
    assert _chat(srv, msgs, BOB, cache_salt="x")[2] == 0
    assert _chat(srv, msgs, ALICE, cache_salt="x")[2] == prompt - 1


def test_shared_isolation_lets_keys_share(start_server, tool_qwen2):
    srv = start_server(
        tool_qwen2, engine=SMALL, security={**KEYS, "prefix_cache_isolation": "shared"}
    )
    msgs = _messages()
    text, prompt, cached = _chat(srv, msgs, ALICE)
    assert cached == 0
    assert _chat(srv, msgs, BOB) == (text, prompt, prompt - 1)  # another key's hit
    # equal cache_salt values still share across keys, others do not
    assert _chat(srv, msgs, ALICE, cache_salt="team") == (text, prompt, 0)
    assert _chat(srv, msgs, BOB, cache_salt="team")[2] == prompt - 1
    assert _chat(srv, msgs, BOB, cache_salt="other")[2] == 0


def _disk_server(home: Path, model: Path) -> LiveServer:
    return LiveServer(
        make_settings(
            home,
            model,
            security=KEYS,
            engine={**SMALL, "prefix_cache_disk_min_tokens": 64, "prefix_cache_disk_writes": "all"},
        )
    ).start()


def _disk(srv) -> dict:
    (m,) = httpx.get(
        srv.url + "/health", headers={"Authorization": f"Bearer {ALICE}"}, timeout=10
    ).json()["models"]
    return m["prefix_cache"]["disk"]


def test_the_disk_tier_keeps_each_keys_prefixes_apart_across_a_restart(tmp_path, tool_qwen2):
    msgs = _messages()
    first = _disk_server(tmp_path, tool_qwen2)
    try:
        text, prompt, _ = _chat(first, msgs, ALICE)
    finally:
        first.stop()  # the engine core finishes its queued writes before it exits
    files = list((tmp_path / "prefix-cache").glob("*/*.safetensors"))
    assert len(files) == 1

    second = _disk_server(tmp_path, tool_qwen2)
    try:
        assert _disk(second)["entries"] == 1  # back from the file's header
        assert _chat(second, msgs, BOB) == (text, prompt, 0)
        assert _chat(second, msgs, ALICE, cache_salt="x") == (text, prompt, 0)
        assert _disk(second)["hits"] == 0
        got = _chat(second, msgs, ALICE)  # read back from alice's file
        assert got == (text, prompt, prompt - 1)
        assert _disk(second)["hits"] == 1
    finally:
        second.stop()
