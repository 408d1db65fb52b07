"""A quantized KV cache on text models through HTTP (engine.kv_bits 4 and 8,
engines/kv_quant.py): batches of mixed lengths, cancellation, prefix-cache hits from
quantized entries in memory and on disk, prompt-lookup speculation, JSON-schema output and
logprobs; 8-bit greedy output agrees with full precision; bad widths are load errors.

The model has 64-dimension heads (the fixtures' default 16 is below the smallest group)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import LiveServer, make_settings
from fixtures.tiny_models import make_tiny_chat_model

CHAT = "/v1/chat/completions"
MODEL = "wide-llama"
SYSTEM = "You are a careful agent. Follow the tool rules exactly. " * 12
LOOP = "the cat sat on the mat and the dog sat on the log and the cat sat on the"


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory) -> Path:
    return make_tiny_chat_model(
        tmp_path_factory.mktemp("m") / MODEL,
        "llama",
        hidden_size=128,
        head_dim=64,
        max_position_embeddings=2048,
    )


def _server(home: Path, model: Path, **engine) -> LiveServer:
    base = {"max_num_seqs": 8, "prefix_cache_min_tokens": 0, "warmup": False}
    return LiveServer(make_settings(home, model, engine={**base, **engine})).start()


@pytest.fixture(scope="module")
def full(tmp_path_factory, wide_llama):
    srv = _server(tmp_path_factory.mktemp("full"), wide_llama)
    yield srv
    srv.stop()


@pytest.fixture(scope="module", params=[8, 4])
def quant(request, tmp_path_factory, wide_llama):
    srv = _server(tmp_path_factory.mktemp(f"q{request.param}"), wide_llama, kv_bits=request.param)
    yield srv
    srv.stop()


def _body(content: str, max_tokens: int = 12, **kw) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **kw,
    }


def _chat(srv: LiveServer, body: dict) -> dict:
    with srv.client(timeout=120) as c:
        r = c.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _view(srv: LiveServer) -> dict:
    return next(m for m in srv.health()["models"] if m["name"] == MODEL)


def _tokens(srv: LiveServer, content: str, n: int) -> list[str]:
    out = _chat(srv, _body(content, n, logprobs=True))
    return [t["token"] for t in out["choices"][0]["logprobs"]["content"]]


def test_mixed_lengths_decode_together_on_a_quantized_cache(quant, full):
    """Short and long prompts and generations in one batch all finish with their full
    usage; /health shows the bits and fewer KV bytes per token than full precision."""
    bodies = [
        _body("Hi", 30),
        _body(SYSTEM, 6),
        _body("tell me a story " * 10, 20),
        _body(SYSTEM + " and more", 40),
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        outs = list(pool.map(lambda b: _chat(quant, b), bodies))
    for b, out in zip(bodies, outs, strict=True):
        assert out["usage"]["completion_tokens"] == b["max_tokens"]  # the tiny model loops
        assert out["choices"][0]["message"]["content"]
    view, ref = _view(quant), _view(full)
    bits = quant.settings.engine.kv_bits
    assert view["options"]["kv_bits"] == bits and view["options"]["kv_group_size"] == 64
    assert view["max_batch_size_seen"] >= 2
    per_token, plain = view["options"]["kv_bytes_per_token"], ref["options"]["kv_bytes_per_token"]
    assert ref["options"]["kv_bits"] is None
    assert per_token < plain / 3  # float32 here: 8 bits is ~1/3.6, 4 bits ~1/6.4


def test_eight_bit_greedy_tokens_agree_with_full_precision(full, tmp_path, wide_llama):
    q8 = _server(tmp_path, wide_llama, kv_bits=8)
    try:
        prompts = ["Hi", "tell me a story " * 10, SYSTEM]
        got = [_tokens(q8, p, 16) for p in prompts]
    finally:
        q8.stop()
    want = [_tokens(full, p, 16) for p in prompts]
    same = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    assert [g[:4] for g in got] == [w[:4] for w in want]
    assert same >= 0.9 * sum(map(len, want))


def test_a_second_request_reuses_a_quantized_prefix(quant):
    system = "Reuse me. " + SYSTEM  # a prefix no other test sends
    first = _chat(quant, _body(system + " first question", 4))
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = _chat(quant, _body(system + " second question", 4))
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
    prefix = _view(quant)["prefix_cache"]
    assert prefix["hits"] >= 1 and prefix["bytes"] > 0


def test_cancelled_stream_leaves_the_batch_serving(quant):
    """A client that goes away mid-stream frees its row; the next requests still run."""
    body = _body("tell me a long story " * 4, 400, stream=True)
    with httpx.Client(base_url=quant.url, timeout=60) as c:
        with c.stream("POST", CHAT, json=body) as r:
            assert r.status_code == 200
            for n, _ in enumerate(r.iter_lines()):
                if n > 5:
                    break
    deadline = time.time() + 60
    while _view(quant)["running"] and time.time() < deadline:
        time.sleep(0.05)
    assert _view(quant)["running"] == 0
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda b: _chat(quant, b), [_body("Hi", 8)] * 3))
    assert all(o["usage"]["completion_tokens"] == 8 for o in outs)


def test_json_schema_and_logprobs_on_a_quantized_cache(quant):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "pet": {"enum": ["cat", "dog"]}},
        "required": ["ok", "pet"],
        "additionalProperties": False,
    }
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}
    out = _chat(quant, _body("Give me a person", 200, response_format=rf))  # whitespace is bounded
    person = json.loads(out["choices"][0]["message"]["content"])
    assert isinstance(person["ok"], bool) and person["pet"] in ("cat", "dog")
    out = _chat(quant, _body("Hi", 6, logprobs=True, top_logprobs=2))
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == 6
    assert all(t["logprob"] <= 0 and len(t["top_logprobs"]) == 2 for t in content)


def test_prompt_lookup_speculates_on_a_quantized_cache(tmp_path, wide_llama):
    srv = _server(
        tmp_path,
        wide_llama,
        kv_bits=8,
        speculative="prompt-lookup",
        speculative_policy="always",  # verify every step: the cost policy is not under test
        speculative_max_batch=8,
        prefix_cache_bytes=0,
    )
    try:
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda i: _chat(srv, _body(LOOP + f" {i}", 24)), range(4)))
        assert all(o["usage"]["completion_tokens"] == 24 for o in outs)
        spec = _view(srv)["speculative"]
    finally:
        srv.stop()
    assert spec["mode"] == "prompt-lookup"
    assert spec["verify_steps"] > 0 and spec["accepted_tokens"] > 0


def test_kv_quant_start_keeps_short_exchanges_in_full_precision(full, tmp_path, wide_llama):
    """Under kv_quant_start a short exchange never quantizes (the full-precision answer,
    logprobs and all); batches whose rows grow past it quantize mid-flight and finish."""
    srv = _server(tmp_path, wide_llama, kv_bits=4, kv_quant_start=48)
    try:
        short = _body("Hi", 8, logprobs=True)
        alone = _chat(srv, short)
        assert alone["usage"]["total_tokens"] <= 48
        bodies = [_body("Hi", 60), _body(SYSTEM, 10), _body("tell me", 30), short]
        with ThreadPoolExecutor(len(bodies)) as pool:
            outs = list(pool.map(lambda b: _chat(srv, b), bodies))
        view = _view(srv)
    finally:
        srv.stop()
    assert alone["choices"][0] == _chat(full, short)["choices"][0]
    assert [o["usage"]["completion_tokens"] for o in outs] == [60, 10, 30, 8]
    assert view["options"]["kv_quant_start"] == 48 and view["options"]["kv_bits"] == 4


def test_quantized_prefix_survives_a_restart_on_disk(tmp_path, wide_llama):
    """The disk tier writes quantized entries (mlx-lm's prompt-cache format) and a new
    process reads them back: the same answer, with the prefix cached."""
    disk = {
        "kv_bits": 4,
        "prefix_cache_disk_bytes": 1 << 26,
        "prefix_cache_disk_min_tokens": 64,
        "prefix_cache_disk_writes": "all",
    }
    body = _body(SYSTEM + " what now?", 8)
    srv = _server(tmp_path, wide_llama, **disk)
    try:
        cold = _chat(srv, body)
        deadline = time.time() + 30
        while time.time() < deadline:
            d = _view(srv)["prefix_cache"]["disk"]
            if d["entries"] and not d["writes_pending"]:
                break
            time.sleep(0.05)
        assert d["entries"] >= 1, d
    finally:
        srv.stop()
    srv = _server(tmp_path, wide_llama, **disk)
    try:
        warm = _chat(srv, body)
        d = _view(srv)["prefix_cache"]["disk"]
    finally:
        srv.stop()
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 100
    assert d["hits"] >= 1
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]


@pytest.mark.parametrize(
    ("engine", "says"),
    [
        ({"kv_bits": 6}, "take kv_bits 4 or 8"),
        ({"kv_bits": 3.5}, "take kv_bits 4 or 8"),
        ({"kv_bits": 8, "kv_group_size": 128}, "kv_group_size 128 does not divide"),
    ],
)
def test_widths_a_text_model_cannot_take_are_load_errors(tmp_path, wide_llama, engine, says):
    from mlxd.core.errors import ModelLoadError
    from mlxd.engines.registry import create_engine

    settings = make_settings(tmp_path, wide_llama, engine=engine)
    with pytest.raises(ModelLoadError, match=says):
        create_engine("chat", MODEL, wide_llama, settings)
