"""Priorities, fair shares between API keys and preemption, observed through HTTP.

The servers here have two slots (``engine.max_num_seqs: 2``, one for the preemption test),
so that requests queue; who started first is read from the order of first tokens and of
completions, never from how long anything took.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest
from conftest import wait_until

from mlxd.config import ConfigError

KEY_A, KEY_B, ADMIN = "sk-flood-aaaa", "sk-single-bbbb", "sk-admin-cccc"


def _eos_ban(model: Path) -> dict[str, float]:
    """A logit_bias that keeps the random fixture model from ending early: requests here
    must run their max_tokens out."""
    added = json.loads((model / "tokenizer.json").read_text())["added_tokens"]
    ends = [t["id"] for t in added if t["content"] in ("<|im_end|>", "<|endoftext|>")]
    assert ends
    return {str(i): -100.0 for i in ends}


def _queue(srv, model: str, key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    health = httpx.get(srv.url + "/health", headers=headers, timeout=10).json()
    return next(m for m in health["models"] if m["name"] == model)["queue"]


class Streams:
    """Streaming completions in threads; ``started`` records the order of first tokens,
    ``ended`` that of completed streams (a list that several may share)."""

    def __init__(self, srv, key: str | None = None, ended: list[str] | None = None) -> None:
        self.srv, self.key = srv, key
        self.started: list[str] = []
        self.ended: list[str] = [] if ended is None else ended
        self.texts: dict[str, str] = {}
        self.usage: dict[str, dict] = {}
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.stop = threading.Event()  # set: every stream hangs up (the server cancels it)

    def start(self, tag: str, body: dict) -> None:
        t = threading.Thread(target=self._run, args=(tag, body), daemon=True)
        self.threads.append(t)
        t.start()

    def _run(self, tag: str, body: dict) -> None:
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        text = []
        try:
            with httpx.stream(
                "POST",
                self.srv.url + "/v1/completions",
                json={**body, "stream": True},
                headers=headers,
                timeout=600,
            ) as r:
                if r.status_code != 200:
                    self.errors.append(f"{tag}: {r.status_code} {r.read()!r}")
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        self.usage[tag] = chunk["usage"]
                    if not chunk["choices"]:
                        continue
                    with self._lock:
                        if tag not in self.started:
                            self.started.append(tag)
                    text.append(chunk["choices"][0]["text"])
                    if self.stop.is_set():
                        return
        except httpx.HTTPError as exc:
            self.errors.append(f"{tag}: {exc!r}")
        self.texts[tag] = "".join(text)
        with self._lock:
            self.ended.append(tag)

    def join(self, stop: bool = False) -> None:
        if stop:
            self.stop.set()
        for t in self.threads:
            t.join(600)
        assert not self.errors, self.errors


def _preemptions(metrics: str, reason: str, model: str = "long-llama") -> float:
    """mlxd:preemptions_total for ``model`` and ``reason`` in a /metrics text (0: none yet)."""
    head = f'mlxd:preemptions_total{{model="{model}",reason="{reason}"}} '
    return sum(float(x[len(head) :]) for x in metrics.splitlines() if x.startswith(head))


def _keys_server(start_server, model: Path, **engine):
    return start_server(
        model,
        engine={"max_num_seqs": 2, **engine},
        security={"api_keys": [{"key": KEY_A, "name": "a"}, {"key": KEY_B, "name": "b"}]},
    )


def _body(model: Path, prompt: str, max_tokens: int, **kw) -> dict:
    return {
        "model": model.name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logit_bias": _eos_ban(model),
        **kw,
    }


def test_a_better_priority_overtakes_the_queue(start_server, long_llama):
    """32 priority-10 requests queue behind two slots; a priority-0 one sent after them
    starts before every one still waiting (at most the two running ones, and the two that
    took the slots it left, started first)."""
    srv = start_server(long_llama, engine={"max_num_seqs": 2})
    low = Streams(srv)
    for i in range(32):
        low.start(f"low-{i}", _body(long_llama, f"low {i}", 400, priority=10))
    assert wait_until(lambda: _queue(srv, "long-llama")["by_priority"].get("10", 0) >= 28)
    r = httpx.post(
        srv.url + "/v1/completions", json=_body(long_llama, "urgent", 4, priority=0), timeout=600
    )
    assert r.status_code == 200, r.text
    ahead = list(low.started)  # low-priority requests that started before it ended
    low.join(stop=True)
    assert len(ahead) <= 4, ahead


def test_another_key_gets_the_next_slot_ahead_of_a_flood(start_server, long_llama):
    """With fair preemption off, key A queues 16 requests; key B's one request, sent after
    them at the same priority, gets the next free slot: B has received no service, A a lot.
    No row gives up its slot for it."""
    srv = _keys_server(start_server, long_llama, fair_preemption=False)
    flood = Streams(srv, KEY_A)
    for i in range(16):
        flood.start(f"a-{i}", _body(long_llama, f"flood {i}", 200))
    assert wait_until(lambda: _queue(srv, "long-llama", KEY_A)["by_priority"].get("0", 0) >= 12)
    r = httpx.post(
        srv.url + "/v1/completions",
        json=_body(long_llama, "single", 4),
        headers={"Authorization": f"Bearer {KEY_B}"},
        timeout=600,
    )
    assert r.status_code == 200, r.text
    ahead = list(flood.started)
    flood.join(stop=True)
    assert len(ahead) <= 5, ahead  # the two running, the slot B's wait freed, B's own
    metrics = httpx.get(srv.url + "/metrics", timeout=10).text
    assert 'mlxd:request_queue_time_by_priority_seconds_count{key="b",' in metrics
    assert _preemptions(metrics, "fair") == 0
    assert _queue(srv, "long-llama", KEY_A)["preemptions"] == 0


def test_a_preempted_stream_completes_with_its_own_text(start_server, long_llama):
    """One slot: a priority-10 stream is running when a priority-0 request arrives; the
    priority-0 request ends first, and the preempted stream then completes with exactly
    the greedy text it produces alone (it resumed from the prefix cache)."""
    srv = start_server(long_llama, engine={"max_num_seqs": 1})
    body = _body(
        long_llama,
        "a long story",
        300,
        priority=10,
        stream_options={"include_usage": True},
    )
    alone = Streams(srv)
    alone.start("alone", body)
    alone.join()
    assert _queue(srv, "long-llama")["preemptions"] == 0

    low = Streams(srv)
    low.start("low", body)
    assert wait_until(lambda: "low" in low.started)
    r = httpx.post(
        srv.url + "/v1/completions", json=_body(long_llama, "urgent", 8, priority=0), timeout=600
    )
    assert r.status_code == 200, r.text
    assert "low" not in low.texts  # still streaming when the urgent one ended
    low.join()
    assert _queue(srv, "long-llama")["preemptions"] >= 1
    assert low.texts["low"] == alone.texts["alone"]
    assert len(alone.texts["alone"]) > 0
    # usage counts the client's prompt and output, not the resumption's longer prompt
    used, once = low.usage["low"], alone.usage["alone"]
    assert used["prompt_tokens"] == once["prompt_tokens"]
    assert used["completion_tokens"] == once["completion_tokens"] == 300
    cached = (used.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert cached <= used["prompt_tokens"]
    metrics = httpx.get(srv.url + "/metrics", timeout=10).text
    assert _preemptions(metrics, "priority") >= 1
    assert _preemptions(metrics, "fair") == 0  # without keys every caller is one tenant


def test_a_key_with_nothing_running_takes_a_slot_from_a_flood(start_server, long_llama):
    """Key A holds both slots with long streams and has more queued; key B's one request
    gets a slot at once (A's latest row gives it up) and ends while A's first rows still
    stream. Every A stream, the preempted one too, completes with the text it has alone."""
    srv = _keys_server(start_server, long_llama)
    body = _body(long_llama, "a long story", 400)
    alone = Streams(srv, KEY_A)
    alone.start("alone", body)
    alone.join()

    flood = Streams(srv, KEY_A)
    for i in range(4):
        flood.start(f"a-{i}", body)
    assert wait_until(lambda: len(flood.started) == 2)
    assert wait_until(lambda: _queue(srv, "long-llama", KEY_A)["by_priority"].get("0", 0) == 2)
    r = httpx.post(
        srv.url + "/v1/completions",
        json=_body(long_llama, "single", 8),
        headers={"Authorization": f"Bearer {KEY_B}"},
        timeout=600,
    )
    assert r.status_code == 200, r.text
    ahead, done = list(flood.started), dict(flood.texts)
    assert len(ahead) == 2, ahead  # no third A stream started: the freed slot went to B
    assert done == {}  # B did not wait for an A row to end
    metrics = httpx.get(srv.url + "/metrics", timeout=10).text
    assert _preemptions(metrics, "fair") == 1
    assert _preemptions(metrics, "priority") == 0
    flood.join()
    assert _queue(srv, "long-llama", KEY_A)["preemptions"] == 1
    assert len(alone.texts["alone"]) > 0
    assert flood.texts == {f"a-{i}": alone.texts["alone"] for i in range(4)}


def test_two_flooding_keys_never_preempt_each_other(start_server, long_llama):
    """Keys A and B each keep requests queued behind the two slots. When A's first row ends,
    B has received less service than A (its long row started later), yet the free slot goes
    to A, which has no row running: had it gone to B, A would be starved and preempt one of
    B's rows. Slots change hands many times, and no row is preempted for fairness."""
    srv = _keys_server(start_server, long_llama)
    ended: list[str] = []
    a, b = Streams(srv, KEY_A, ended), Streams(srv, KEY_B, ended)
    a.start("a-0", _body(long_llama, "flood a 0", 200))
    assert wait_until(lambda: "a-0" in a.started)
    b.start("b-0", _body(long_llama, "flood b 0", 400))
    assert wait_until(lambda: "b-0" in b.started)
    for i in range(1, 5):
        a.start(f"a-{i}", _body(long_llama, f"flood a {i}", 60))
        b.start(f"b-{i}", _body(long_llama, f"flood b {i}", 60))
    assert wait_until(lambda: _queue(srv, "long-llama", KEY_A)["by_priority"].get("0", 0) == 8)
    a.join()
    b.join()
    assert len(a.texts) == len(b.texts) == 5
    # slots changed hands while b-0 ran (a-1..a-4 may reach the server in any order)
    assert min(ended.index(f"a-{i}") for i in range(1, 5)) < ended.index("b-0"), ended
    metrics = httpx.get(srv.url + "/metrics", timeout=10).text
    assert _preemptions(metrics, "fair") == 0
    assert _queue(srv, "long-llama", KEY_A)["preemptions"] == 0


BAD_PRIORITIES = ["high", 1.5, True, 5000, -5000, [0]]

ROUTES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "openai"),
    ("/v1/completions", {"prompt": "hi"}, "openai"),
    ("/v1/responses", {"input": "hi"}, "openai"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, "anth"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "stream": False}, "ollama"),
    ("/api/generate", {"prompt": "hi", "stream": False}, "ollama"),
    ("/generate", {"prompt": "hi"}, "openai"),
]


def _assert_dialect_400(r: httpx.Response, dialect: str) -> None:
    assert r.status_code == 400, r.text
    body = r.json()
    if dialect == "ollama":
        assert isinstance(body["error"], str) and "priority" in body["error"]
    elif dialect == "anth":
        assert body["type"] == "error" and "priority" in body["error"]["message"]
    else:
        assert body["error"]["type"] == "invalid_request_error"
        assert "priority" in (body["error"].get("param") or "") + body["error"]["message"]


@pytest.mark.parametrize(("path", "extra", "dialect"), ROUTES)
def test_a_bad_priority_is_a_400_in_the_dialect(server, path, extra, dialect):
    for bad in BAD_PRIORITIES:
        r = httpx.post(
            server.url + path,
            json={"model": "tiny-llama", "max_tokens": 2, **extra, "priority": bad},
            timeout=60,
        )
        _assert_dialect_400(r, dialect)
    ok = httpx.post(
        server.url + path,
        json={"model": "tiny-llama", "max_tokens": 2, **extra, "priority": 100},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text


def test_key_file_priority_and_weight(start_server, tiny_llama, tmp_path):
    """A key's priority is its requests' default and the best it may ask for; an admin key
    may ask for any; the key file's attributes are parsed, and a wrong one is refused."""
    keys = tmp_path / "keys.txt"
    keys.write_text(
        f"# team keys\nalice:{KEY_A} priority=5 weight=2\nops:{ADMIN} admin priority=5\n"
    )
    srv = start_server(tiny_llama, security={"api_key_file": str(keys)})

    def ask(key: str, path: str, extra: dict, **kw) -> httpx.Response:
        return httpx.post(
            srv.url + path,
            json={"model": "tiny-llama", "max_tokens": 2, **extra, **kw},
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )

    for path, extra, dialect in ROUTES:
        _assert_dialect_400(ask(KEY_A, path, extra, priority=4), dialect)
        assert ask(KEY_A, path, extra, priority=7).status_code == 200
        assert ask(ADMIN, path, extra, priority=-5).status_code == 200
    assert ask(KEY_A, "/v1/completions", {"prompt": "hi"}).status_code == 200
    metrics = httpx.get(srv.url + "/metrics", timeout=10).text
    assert 'mlxd:request_queue_time_by_priority_seconds_count{key="alice",' in metrics
    line = next(
        x
        for x in metrics.splitlines()
        if x.startswith("mlxd:request_queue_time_by_priority_seconds_count")
        and 'key="alice"' in x
        and 'priority="5"' in x
    )
    assert float(line.split()[-1]) >= 1  # the request that asked for none ran at its key's

    bad = tmp_path / "bad-keys.txt"
    bad.write_text(f"bob:{KEY_B} weight=0\n")
    with pytest.raises(ConfigError, match="key line 1: weight") as refused:
        start_server(tiny_llama, security={"api_key_file": str(bad)})
    assert KEY_B not in str(refused.value)
