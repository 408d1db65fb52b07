"""The prefix cache's disk tier through HTTP: a conversation survives a restart, or the
memory tier's eviction within one process, the byte bound holds (set from the
environment), files that must not load (corrupt, truncated, another model, another
mlxd version) are removed while the request still succeeds with the cold answer, and by
default only reused prefixes are written (one-off prompts cost no write)."""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from conftest import LiveServer, make_settings, wait_until

SYSTEM = {
    "role": "system",
    "content": "You are a careful agent. Follow the tool rules exactly. " * 14,
}
DISK = {"prefix_cache_disk_min_tokens": 64, "warmup": False}
# the tier's mechanics below are shown on first turns: written only with "all"
ALL = {"prefix_cache_disk_writes": "all"}


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


def _chat(srv, messages, max_tokens=8):
    model = Path(srv.settings.models.default).name
    r = _client(srv).chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=max_tokens
    )
    return r.choices[0].message.content, r.usage


def _disk(srv) -> dict:
    (m,) = [m for m in srv.health()["models"] if m["name"] == "tool-qwen2"]
    return m["prefix_cache"]["disk"]


def _settled(srv, entries: int | None = None) -> dict:
    """The disk tier's stats once its queued writes are on disk."""

    def settled() -> bool:
        d = _disk(srv)
        return not d["writes_pending"] and (entries is None or d["entries"] >= entries)

    assert wait_until(settled, 30), _disk(srv)
    return _disk(srv)


def _metric(srv, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    m = re.search(rf'^{re.escape(name)}\{{model="tool-qwen2"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def _files(home: Path) -> list[Path]:
    return sorted((home / "prefix-cache").glob("*/*.safetensors"))


def _server(home: Path, model: Path, **engine) -> LiveServer:
    return LiveServer(make_settings(home, model, engine={**DISK, **engine})).start()


@pytest.fixture(scope="module")
def cold(tmp_path_factory, tool_qwen2):
    """The reference: no prefix cache at all (every prompt prefilled)."""
    srv = _server(tmp_path_factory.mktemp("cold"), tool_qwen2, prefix_cache_bytes=0)
    yield srv
    srv.stop()


def _turns(n: int, tag: str = "") -> list[list[dict]]:
    """The prompts of an n-turn conversation (assistant turns filled in as it goes)."""
    return [[{"role": "user", "content": f"Step {i}{tag * 8}: list the files."}] for i in range(n)]


def _converse(srv, turns, history=None) -> tuple[list[dict], list[str], int]:
    """(the history, the assistant's answers, the last prompt's length in tokens)"""
    history = list(history or [SYSTEM])
    said, prompt = [], 0
    for user in turns:
        history += user
        text, usage = _chat(srv, history)
        said.append(text)
        prompt = usage.prompt_tokens
        history.append({"role": "assistant", "content": text})
    return history, said, prompt


def test_a_conversation_continues_from_disk_after_a_restart(tmp_path, tool_qwen2, cold):
    first = _server(tmp_path, tool_qwen2)  # default writes: the second turn reused the first
    history, said, last_prompt = _converse(first, _turns(2))
    first.stop()  # at once: the engine core finishes its queued writes before it exits
    assert _files(tmp_path)

    second = _server(tmp_path, tool_qwen2)
    try:
        d = _disk(second)
        assert d["entries"] >= 1  # the index came back from the file headers
        on_disk = d["bytes"]
        # two requests continuing the conversation at once: they share one read
        asks = [
            history + [{"role": "user", "content": f"Step 2, option {i}: list the files."}]
            for i in range(2)
        ]
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda m: _chat(second, m), asks))
        for _, usage in got:
            # at least the whole prompt of the first server's last turn came from disk
            assert usage.prompt_tokens_details.cached_tokens >= last_prompt
        d = _disk(second)
        # one read between them (bytes read <= the one file); both count as disk hits when
        # the second arrives while the read is in flight, else it finds the prefix already
        # in memory (how the two arrive is up to the machine's load)
        assert d["hits"] in (1, 2) and 0 < d["bytes_read"] <= on_disk
        assert _metric(second, "mlxd:prefix_cache_disk_hits_total") == d["hits"]
        assert _metric(second, "mlxd:prefix_cache_disk_read_bytes_total") == d["bytes_read"]
        # greedy output is that of a server that prefilled everything
        _, cold_said, _ = _converse(cold, _turns(2))
        assert cold_said == said
        assert [text for text, _ in got] == [_chat(cold, m)[0] for m in asks]
    finally:
        second.stop()


def _memory(srv) -> dict:
    (m,) = [m for m in srv.health()["models"] if m["name"] == "tool-qwen2"]
    return {k: v for k, v in m["prefix_cache"].items() if k != "disk"}


def test_a_prefix_the_memory_tier_evicted_comes_back_from_disk_in_the_same_process(
    tmp_path, tool_qwen2, cold
):
    """The memory tier holds one conversation (~260 KB of KV), not two: the second, once it
    shows reuse (a full tier turns a first turn away), evicts the first, whose next turn is
    then read from the disk tier -- no restart."""
    srv = _server(tmp_path, tool_qwen2, prefix_cache_bytes=400_000, **ALL)
    try:
        systems = [
            {"role": "system", "content": f"Agent {tag}. " + SYSTEM["content"]} for tag in "ab"
        ]
        a_history, _, a_prompt = _converse(srv, _turns(1, "a"), [systems[0]])
        _settled(srv, entries=1)
        b_history, _, b_prompt = _converse(srv, _turns(1, "b"), [systems[1]])
        d = _settled(srv, entries=2)
        assert _memory(srv)["entries"] == 1 and _memory(srv)["skipped"] == 1  # a stays...
        assert d["entries"] == 2 and d["hits"] == 0  # ...both are on disk (writes: all)
        # nothing anywhere for either first turn: two disk misses, in /metrics as well
        assert d["misses"] == 2
        assert _metric(srv, "mlxd:prefix_cache_disk_misses_total") == 2
        # b's next turn is read back from disk, and b (reused now) pushes a out of memory
        _, usage = _chat(srv, b_history + [{"role": "user", "content": "Next."}])
        assert usage.prompt_tokens_details.cached_tokens >= b_prompt
        assert _memory(srv)["entries"] == 1 and _disk(srv)["hits"] == 1

        nxt = a_history + [{"role": "user", "content": "Next."}]
        text, usage = _chat(srv, nxt)
        assert usage.prompt_tokens_details.cached_tokens >= a_prompt
        d = _disk(srv)
        assert d["hits"] == 2 and d["bytes_read"] > 0 and d["misses"] == 2
        assert _metric(srv, "mlxd:prefix_cache_disk_hits_total") == 2
        assert text == _chat(cold, nxt)[0]
    finally:
        srv.stop()


def test_the_disk_bound_holds_and_evicts_least_recently_used(tmp_path, tool_qwen2, monkeypatch):
    """The bound comes from MLXD_ENGINE__PREFIX_CACHE_DISK_BYTES, as an operator sets it."""

    def talk(srv, tag: str) -> Path:
        """A conversation of its own (no shared system prompt); the file it left."""
        before = set(_files(tmp_path))
        system = {"role": "system", "content": f"Agent {tag}. " + SYSTEM["content"]}
        _converse(srv, _turns(1, tag), [system])
        _settled(srv)
        return (set(_files(tmp_path)) - before).pop()

    monkeypatch.setenv("MLXD_ENGINE__PREFIX_CACHE_DISK_WRITES", "all")
    srv = _server(tmp_path, tool_qwen2)
    a = talk(srv, "a")
    one = _disk(srv)["bytes"]
    srv.stop()

    bound = int(2.5 * one)
    monkeypatch.setenv("MLXD_ENGINE__PREFIX_CACHE_DISK_BYTES", str(bound))
    srv = _server(tmp_path, tool_qwen2)
    try:
        assert _disk(srv)["max_bytes"] == bound
        b, c, d = (talk(srv, tag) for tag in "bcd")
        stats = _settled(srv)
        assert stats["entries"] == 2 and stats["bytes"] <= bound
        assert stats["evictions"] == 2 and stats["hits"] == 0
        # the least recently used went first: a (from before the restart), then b
        assert _files(tmp_path) == sorted([c, d])
        assert not a.exists() and not b.exists()
        assert _metric(srv, "mlxd:prefix_cache_disk_evictions_total") == 2
        assert _metric(srv, "mlxd:prefix_cache_disk_bytes") == stats["bytes"]
        assert (
            _metric(srv, "mlxd:prefix_cache_disk_written_bytes_total")
            == stats["bytes_written"]
            > 2 * one
        )
    finally:
        srv.stop()


def test_files_that_must_not_load_are_removed_and_requests_still_succeed(
    tmp_path, tool_qwen2, plain_llama, cold
):
    tags = (" flip", " cut", " version", " model")
    srv = _server(tmp_path, tool_qwen2, **ALL)
    written = []
    for tag in tags:
        before = set(_files(tmp_path))
        history, _, _ = _converse(srv, _turns(1, tag))
        _settled(srv)
        (new,) = set(_files(tmp_path)) - before
        written.append((history, new))
    srv.stop()
    # a file of another model: plain-llama's, written under its own fingerprint
    other = _server(tmp_path, plain_llama, **ALL)
    _converse(other, _turns(1, " model"))
    other.stop()
    foreign = [f for f in _files(tmp_path) if f.parent != written[0][1].parent]
    assert foreign

    flip, cut, version, model = (p for _, p in written)
    raw = bytearray(flip.read_bytes())
    raw[-9] ^= 0xFF
    flip.write_bytes(bytes(raw))
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    raw = bytearray(version.read_bytes())
    i = raw.index(b'"0.mlxd_version":"') + len(b'"0.mlxd_version":"')
    raw[i] = ord("9") if raw[i] != ord("9") else ord("8")
    version.write_bytes(bytes(raw))
    os.replace(foreign[0], model)  # same name, other model's content

    srv = _server(tmp_path, tool_qwen2, **ALL)
    try:
        # at start: the truncated file, the other version's and the other model's go
        d = _disk(srv)
        assert d["removed_invalid"] == 3 and d["entries"] == 1
        assert not cut.exists() and not version.exists() and not model.exists()
        for history, _ in written:  # every request answers, as a cold server does
            nxt = history + [{"role": "user", "content": "Next."}]
            text, usage = _chat(srv, nxt)
            assert text == _chat(cold, nxt)[0]
        # the flipped bytes passed the header check and failed the checksum on reading
        d = _disk(srv)
        assert d["hits"] == 0 and d["removed_invalid"] == 4
        assert not flip.exists()
    finally:
        srv.stop()


def test_by_default_one_off_prompts_are_never_written_and_reused_prefixes_are(tmp_path, tool_qwen2):
    """``prefix_cache_disk_writes: reused`` (the default): first turns of unrelated
    conversations write nothing (no file, no bytes, nothing queued); the next turn of one
    of them, which starts from the memory tier's copy of its prefix, is written."""
    srv = _server(tmp_path, tool_qwen2)
    try:
        histories = []
        for tag in "xyz":
            system = {"role": "system", "content": f"Agent {tag}. " + SYSTEM["content"]}
            history, _, _ = _converse(srv, _turns(1, tag), [system])
            histories.append(history)
        d = _settled(srv)
        assert d["entries"] == 0 and d["bytes_written"] == 0 and not _files(tmp_path)
        assert _memory(srv)["entries"] == 3  # the memory tier keeps them all

        nxt = histories[1] + [{"role": "user", "content": "Next."}]
        _, usage = _chat(srv, nxt)
        assert usage.prompt_tokens_details.cached_tokens > 0
        d = _settled(srv, entries=1)
        assert d["entries"] == 1 and d["bytes_written"] > 0 and len(_files(tmp_path)) == 1
        assert _metric(srv, "mlxd:prefix_cache_disk_written_bytes_total") == d["bytes_written"]
    finally:
        srv.stop()
