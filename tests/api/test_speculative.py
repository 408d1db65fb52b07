"""Speculative decoding through HTTP: the same greedy tokens with and without it (prompt
lookup and a draft model, 1, 4 and 16 concurrent requests), stop strings, JSON-schema
output and logprobs unchanged, sampled requests served, and the acceptance metrics moving.

The tiny random-weight fixtures tend to fall into loops, so a prompt that already repeats
gives prompt lookup drafts that the model accepts."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import LiveServer, install_into_store, make_settings
from fixtures.tiny_models import make_tiny_chat_model

BASE = "the cat sat on the mat and the dog sat on the log and the cat sat on the"
PROMPTS = [BASE + " x" * (i % 5) + f" {i}" * (i // 5) for i in range(16)]
MODEL = "tiny-llama"


def _engine(**kw) -> dict:
    return {"max_num_seqs": 16, "prefix_cache_bytes": 0, **kw}


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tiny_llama):
    srv = LiveServer(make_settings(tmp_path_factory.mktemp("spec-off"), tiny_llama,
                                   engine=_engine())).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def lookup(tmp_path_factory, tiny_llama):
    """Prompt lookup, with the prefix cache on (every hit): the prompts repeat across tests,
    so later requests start from KV caches that finished verify steps left behind."""
    srv = LiveServer(make_settings(
        tmp_path_factory.mktemp("spec-lookup"), tiny_llama,
        engine=_engine(speculative="prompt-lookup", speculative_max_batch=16,
                       prefix_cache_bytes=1 << 28, prefix_cache_min_tokens=0))).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def drafted(tmp_path_factory, tiny_llama):
    """A draft model from the store: another tiny llama (other weights, same tokenizer)."""
    home = tmp_path_factory.mktemp("spec-draft")
    src = make_tiny_chat_model(tmp_path_factory.mktemp("m") / "draft-src", "llama", seed=7)
    install_into_store(home / "models", "tiny-draft", src)
    srv = LiveServer(make_settings(
        home, tiny_llama, engine=_engine(speculative="draft", draft_model="tiny-draft",
                                         speculative_max_batch=16))).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def self_drafted(tmp_path_factory, tiny_llama):
    """The target as its own draft (a directory path): every draft token is accepted."""
    copy = tmp_path_factory.mktemp("m") / "same-draft"
    shutil.copytree(tiny_llama, copy)
    srv = LiveServer(make_settings(
        tmp_path_factory.mktemp("spec-self"), tiny_llama,
        engine=_engine(speculative="draft", draft_model=str(copy)))).start()
    yield srv
    srv.stop()


def _complete(srv, prompt: str, **kw) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, **kw}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _texts(srv, prompts: list[str], **kw) -> list[str]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: _complete(srv, p, **kw)["text"], prompts))


def _spec_stats(srv) -> dict:
    model = next(m for m in srv.health()["models"] if m["name"] == MODEL)
    return model["speculative"]


def _metric(srv, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    m = re.search(rf'^{re.escape(name)}{{model="{MODEL}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_prompt_lookup_greedy_tokens_match_plain_decoding(plain, lookup, batch):
    prompts = PROMPTS[:batch]
    before = _spec_stats(lookup)["accepted_tokens"]
    assert _texts(lookup, prompts) == _texts(plain, prompts)
    stats = _spec_stats(lookup)
    assert stats["mode"] == "prompt-lookup"
    assert stats["accepted_tokens"] > before  # drafts were verified and taken, not skipped


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_draft_model_greedy_tokens_match_plain_decoding(plain, drafted, batch):
    prompts = PROMPTS[:batch]
    before = _spec_stats(drafted)["draft_tokens"]
    assert _texts(drafted, prompts) == _texts(plain, prompts)
    assert _spec_stats(drafted)["draft_tokens"] > before


def test_a_self_draft_is_always_accepted_and_the_metrics_show_it(plain, self_drafted):
    assert _texts(self_drafted, PROMPTS[:2]) == _texts(plain, PROMPTS[:2])
    stats = _spec_stats(self_drafted)
    assert stats["acceptance_rate"] == 1.0
    assert stats["tokens_per_step"] > 2
    assert _metric(self_drafted, "mlxd:spec_decode_draft_acceptance_rate") == 1.0
    assert _metric(self_drafted, "mlxd:spec_decode_tokens_per_step") > 2
    assert _metric(self_drafted, "mlxd:spec_decode_num_accepted_tokens_total") == \
        _metric(self_drafted, "mlxd:spec_decode_num_draft_tokens_total") > 0


def test_prefix_cache_hits_under_speculation(lookup):
    stats = next(m for m in lookup.health()["models"] if m["name"] == MODEL)["prefix_cache"]
    assert stats["hits"] > 0


def test_prompt_lookup_metrics_move(lookup):
    drafted = _metric(lookup, "mlxd:spec_decode_num_draft_tokens_total")
    accepted = _metric(lookup, "mlxd:spec_decode_num_accepted_tokens_total")
    _texts(lookup, PROMPTS[:1])
    assert _metric(lookup, "mlxd:spec_decode_num_draft_tokens_total") > drafted
    assert _metric(lookup, "mlxd:spec_decode_num_accepted_tokens_total") > accepted
    assert 0 < _metric(lookup, "mlxd:spec_decode_draft_acceptance_rate") <= 1


def test_stop_strings_cut_the_same_place(plain, lookup):
    full = _complete(plain, PROMPTS[0])["text"]
    stop = full.strip().split()[len(full.split()) // 2]  # a word from the middle
    a, b = _complete(lookup, PROMPTS[0], stop=[stop]), _complete(plain, PROMPTS[0], stop=[stop])
    assert a["text"] == b["text"] and a["finish_reason"] == b["finish_reason"] == "stop"
    assert stop not in a["text"]


def test_max_tokens_is_exact_when_drafts_run_past_it(plain, lookup):
    for n in (1, 2, 3, 7):
        a = _complete(lookup, PROMPTS[0], max_tokens=n, logprobs=0)
        assert a["finish_reason"] == "length"
        assert len(a["logprobs"]["tokens"]) == n
        assert a["text"] == _complete(plain, PROMPTS[0], max_tokens=n)["text"]


def test_logprobs_match_plain_decoding(plain, lookup):
    a = _complete(lookup, PROMPTS[1], logprobs=2)["logprobs"]
    b = _complete(plain, PROMPTS[1], logprobs=2)["logprobs"]
    assert a["tokens"] == b["tokens"]
    assert a["token_logprobs"] == pytest.approx(b["token_logprobs"], abs=1e-4)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def _chat(srv, content: str, **kw) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 48, "temperature": 0, **kw}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_json_schema_output_beside_speculating_rows(plain, lookup):
    """A grammar row decodes plainly inside the verify steps of rows that speculate."""
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}
    with ThreadPoolExecutor(4) as pool:
        structured = pool.submit(_chat, lookup, "Give me a person.", response_format=rf)
        others = [pool.submit(_complete, lookup, p) for p in PROMPTS[:3]]
        out = structured.result()
        texts = [f.result()["text"] for f in others]
    assert set(json.loads(out)) == {"name", "age"}
    assert out == _chat(plain, "Give me a person.", response_format=rf)
    assert texts == [_complete(plain, p)["text"] for p in PROMPTS[:3]]


def test_sampled_requests_run_and_seeds_repeat(lookup):
    a = _complete(lookup, PROMPTS[0], temperature=0.8, seed=11)
    b = _complete(lookup, PROMPTS[0], temperature=0.8, seed=11)
    assert a["text"] == b["text"] and a["finish_reason"] == "length"
    # unseeded sampled rows speculate (rejection sampling); they run to max_tokens
    outs = [_complete(lookup, PROMPTS[0], temperature=0.7, top_p=0.9, logprobs=0)
            for _ in range(3)]
    assert all(len(o["logprobs"]["tokens"]) == 24 for o in outs)


def _serve(home, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLXD_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "mlxd", "serve", "--port", "0", *args],
                          env=env, capture_output=True, text=True, timeout=120)


def test_a_draft_model_with_another_tokenizer_stops_the_server_with_a_clear_error(
        tmp_path, tiny_llama):
    other = make_tiny_chat_model(tmp_path / "other-vocab", "llama", vocab_size=640)
    r = _serve(tmp_path / "home", "--model", str(tiny_llama), "--speculative", "draft",
               "--draft-model", str(other))
    assert r.returncode != 0
    assert "draft model other-vocab does not share the tokenizer of 'tiny-llama'" in r.stderr


def test_draft_without_a_draft_model_is_a_configuration_error(tmp_path, tiny_llama):
    r = _serve(tmp_path, "--model", str(tiny_llama), "--speculative", "draft")
    assert r.returncode == 2
    assert "engine.draft_model is not set" in r.stderr
