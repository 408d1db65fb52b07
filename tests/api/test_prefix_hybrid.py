"""Prefix reuse for models with recurrent or sliding-window layers, through HTTP.

Their layers cannot be cut back to an earlier token, so the prefill checkpoints them
(engine.hybrid_checkpoint_tokens apart and at each prompt's end); an agent's next turn,
whose prompt re-renders the previous reply, resumes from the previous prompt's end. Every
answer is compared with a cold prefill of the same prompt on the same server: a request
with a cache_salt of its own reuses nothing.
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import httpx
import pytest
from fixtures.hybrid_models import HYBRID_ARCHS, make_tiny_hybrid_model

NAMES = {"qwen3_next": "tiny-qwen3-next", "gemma3_text": "tiny-gemma3", "mamba2": "tiny-mamba2"}
SYSTEM = "You are a careful agent. Read the tool list and follow its rules exactly. " * 5


@pytest.fixture(scope="module")
def hybrid_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hybrid-models")
    return {a: make_tiny_hybrid_model(root / NAMES[a], a) for a in HYBRID_ARCHS}


@pytest.fixture(scope="module")
def hybrid_server(tmp_path_factory, hybrid_models):
    from conftest import LiveServer, make_settings

    first, *rest = hybrid_models.values()
    srv = LiveServer(
        make_settings(
            tmp_path_factory.mktemp("hybrid-home"),
            first,
            models={"preload": [str(p) for p in rest]},
            # small prefill chunks and checkpoints every 32 tokens: several per prompt
            engine={"hybrid_checkpoint_tokens": 32, "max_step_tokens": 48},
        )
    ).start()
    yield srv
    srv.stop()


def _chat(srv, model: str, messages: list[dict], **extra) -> tuple[str, int, int]:
    """(text, prompt tokens, cached tokens) of a greedy chat completion."""
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        timeout=120,
        json={"model": model, "messages": messages, "temperature": 0, "max_tokens": 10, **extra},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    u = body["usage"]
    return (
        body["choices"][0]["message"]["content"],
        u["prompt_tokens"],
        u["prompt_tokens_details"]["cached_tokens"],
    )


def _complete(srv, model: str, ids: list[int]) -> int:
    """Cached tokens of a greedy completion of the token ids ``ids``."""
    r = httpx.post(
        srv.url + "/v1/completions",
        timeout=120,
        json={"model": model, "prompt": ids, "temperature": 0, "max_tokens": 4},
    )
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _cold(srv, model: str, messages: list[dict]) -> str:
    """The answer of a cold prefill: a partition of its own, where nothing is cached."""
    text, _, cached = _chat(srv, model, messages, cache_salt=uuid.uuid4().hex)
    assert cached == 0
    return text


def _checkpoints(srv, model: str) -> dict:
    m = next(m for m in srv.health()["models"] if m["name"] == model)
    return m["prefix_cache"]["hybrid_checkpoints"]


def _metric(srv, name: str, model: str) -> float:
    for line in httpx.get(srv.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_agent_turns_resume_from_the_previous_prompt_and_match_cold(hybrid_server, arch):
    """Turn n+1's prompt is turn n's prompt, the reply re-rendered (so the cached sequence,
    prompt plus generated tokens, is not a prefix of it) and a new user message: it resumes
    from turn n's prompt end, and its answer is a cold prefill's."""
    model = NAMES[arch]
    tag = uuid.uuid4().hex[:8]
    history = [
        {"role": "system", "content": f"Session {tag}. {SYSTEM}"},
        {"role": "user", "content": "List the files in the project, please."},
    ]
    before = _checkpoints(hybrid_server, model)["hits"]
    prev_prompt = 0
    for turn in range(3):
        text, prompt, cached = _chat(hybrid_server, model, history)
        assert text == _cold(hybrid_server, model, history), f"turn {turn}"
        if turn:
            # the previous prompt, up to its end (mlx-lm's prefill stops one token short
            # when the model cannot sample from its prefill pass), never the reply after it
            assert prev_prompt - 1 <= cached <= prev_prompt, (turn, cached, prev_prompt)
        else:
            assert cached == 0
        history += [
            # a template that re-renders the reply: not the tokens the model generated
            {"role": "assistant", "content": f"Result: {text}"},
            {"role": "user", "content": f"Now open file number {turn}."},
        ]
        prev_prompt = prompt
    stats = _checkpoints(hybrid_server, model)
    assert stats["hits"] >= before + 2
    assert stats["count"] > 0 and stats["bytes"] > 0


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_an_edited_history_resumes_from_a_checkpoint_inside_the_prompt(hybrid_server, arch):
    """A prompt that leaves the cached one inside it (another first question after the same
    system prompt) resumes from the deepest checkpoint the prefill left before that point."""
    model = NAMES[arch]
    system = {"role": "system", "content": f"Session {uuid.uuid4().hex[:8]}. {SYSTEM}"}
    first = [system, {"role": "user", "content": "What is in the config folder?"}]
    _, first_prompt, _ = _chat(hybrid_server, model, first)
    edited = [system, {"role": "user", "content": "Which tests are failing today?"}]
    text, prompt, cached = _chat(hybrid_server, model, edited)
    assert text == _cold(hybrid_server, model, edited)
    # past the chat preamble, short of where the two user messages part
    assert 64 <= cached < first_prompt - 8, (cached, first_prompt)


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_a_new_conversation_resumes_inside_a_system_prompt_an_agent_loop_shared(
    hybrid_server, arch
):
    """After an agent's five turns (each resumed from the one before, so each prefilled only
    its own tail), a new conversation with the same system prompt still resumes from a
    checkpoint inside it: every turn's entry carries the earlier turns' checkpoints."""
    model = NAMES[arch]
    system = {"role": "system", "content": f"Session {uuid.uuid4().hex[:8]}. {SYSTEM}"}
    history = [system, {"role": "user", "content": "List the files in the project, please."}]
    for turn in range(5):
        text, _, cached = _chat(hybrid_server, model, history)
        assert (cached > 0) == (turn > 0)
        history += [
            {"role": "assistant", "content": f"Result: {text}"},
            {"role": "user", "content": f"Now open file number {turn}."},
        ]
    other = [system, {"role": "user", "content": "Which tests are failing today?"}]
    text, prompt, cached = _chat(hybrid_server, model, other)
    assert text == _cold(hybrid_server, model, other)
    assert 64 <= cached < prompt - 8, (cached, prompt)


def test_health_and_metrics_count_checkpoint_hits_misses_and_bytes(hybrid_server):
    model = NAMES["qwen3_next"]
    hits = _metric(hybrid_server, "mlxd:prefix_cache_hybrid_checkpoint_hits_total", model)
    history = [
        {"role": "system", "content": f"Session {uuid.uuid4().hex[:8]}. {SYSTEM}"},
        {"role": "user", "content": "Summarise the changes."},
    ]
    text, _, _ = _chat(hybrid_server, model, history)
    history += [
        {"role": "assistant", "content": f"Result: {text}"},
        {"role": "user", "content": "And the tests?"},
    ]
    assert _chat(hybrid_server, model, history)[2] > 0
    assert _metric(hybrid_server, "mlxd:prefix_cache_hybrid_checkpoint_hits_total", model) > hits
    held = _checkpoints(hybrid_server, model)
    assert (
        _metric(hybrid_server, "mlxd:prefix_cache_hybrid_checkpoint_bytes", model)
        == (held["bytes"])
    )
    assert held["bytes"] > 0
    # a prompt sharing 80 tokens with a cached one, whose first checkpoint (after its
    # first 48-token prefill chunk) is below the 64-token least hit: a miss
    misses = held["misses"]
    rng = random.Random(7)
    ids = [rng.randrange(10, 400) for _ in range(150)]
    _complete(hybrid_server, model, ids)
    _complete(hybrid_server, model, ids[:80] + [rng.randrange(10, 400) for _ in range(40)])
    assert _checkpoints(hybrid_server, model)["misses"] == misses + 1
    assert _metric(hybrid_server, "mlxd:prefix_cache_hybrid_checkpoint_misses_total", model) > 0


def test_checkpoints_count_in_the_prefix_cache_budget(start_server, tmp_path):
    path = make_tiny_hybrid_model(tmp_path / "tiny-qwen3-next", "qwen3_next")
    budget = 300_000
    srv = start_server(
        path,
        engine={
            "prefix_cache_bytes": budget,
            "hybrid_checkpoint_tokens": 16,
            "max_step_tokens": 32,
            "prefix_cache_min_tokens": 16,
            "warmup": False,
        },
    )
    for i in range(6):
        history = [
            {"role": "system", "content": f"Agent {i}. {SYSTEM}"},
            {"role": "user", "content": "Go."},
        ]
        text, _, _ = _chat(srv, "tiny-qwen3-next", history)
        history += [{"role": "assistant", "content": text}, {"role": "user", "content": "More."}]
        _chat(srv, "tiny-qwen3-next", history)
    (m,) = srv.health()["models"]
    pc = m["prefix_cache"]
    assert 0 < pc["hybrid_checkpoints"]["bytes"] < pc["bytes"] <= budget
    assert pc["entries"] < 12


@pytest.mark.parametrize("arch", ["qwen3_next", "gemma3_text"])
def test_checkpoints_survive_a_restart_on_disk(tmp_path, hybrid_models, hybrid_server, arch):
    """The disk tier writes a reused sequence with its checkpoints; after a restart the
    agent's next turn reads them back and resumes from the previous prompt's end."""
    from conftest import LiveServer, make_settings, wait_until

    model = NAMES[arch]
    engine = {
        "prefix_cache_disk_min_tokens": 64,
        "hybrid_checkpoint_tokens": 32,
        "max_step_tokens": 48,
        "warmup": False,
    }

    def server() -> LiveServer:
        return LiveServer(make_settings(tmp_path, hybrid_models[arch], engine=engine)).start()

    def disk(srv) -> dict:
        (m,) = srv.health()["models"]
        return m["prefix_cache"]["disk"]

    history = [
        {"role": "system", "content": f"Session {uuid.uuid4().hex[:8]}. {SYSTEM}"},
        {"role": "user", "content": "List the files in the project, please."},
    ]
    srv = server()
    try:
        for turn in range(2):  # the second turn starts from a cached prefix: it is written
            text, prompt, _ = _chat(srv, model, history)
            history += [
                {"role": "assistant", "content": f"Result: {text}"},
                {"role": "user", "content": f"Now open file number {turn}."},
            ]
        written = wait_until(lambda: not disk(srv)["writes_pending"] and disk(srv)["entries"])
        assert written, disk(srv)
    finally:
        srv.stop()
    srv = server()
    try:
        text, _, cached = _chat(srv, model, history)
        assert prompt - 1 <= cached <= prompt, (cached, prompt)
        assert disk(srv)["hits"] == 1
        assert text == _cold(hybrid_server, model, history)
    finally:
        srv.stop()
