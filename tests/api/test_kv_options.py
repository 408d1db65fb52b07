"""Text models' KV options through HTTP: ``max_kv_size`` bounds the KV cache of a batch
(mlx-lm's rotating caches, engines/bounded_kv.py), and a ``kv_bits`` a text model cannot
take (only 4 or 8: engines/kv_quant.py) is a load error naming the key instead of a
setting silently dropped."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import LiveServer, install_into_store, make_settings

CHAT = "/v1/chat/completions"
LONG = "the quick brown fox jumps over the lazy dog " * 6  # well over the bound in tokens
BOUND = 32


def _body(content: str, max_tokens: int, model: str = "tiny-llama") -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def _loaded(srv: LiveServer, name: str) -> dict:
    return next(m for m in srv.health()["models"] if m["name"] == name)


def test_max_kv_size_bounds_a_text_batch(start_server, tiny_llama):
    """Prompts and generations past the bound run, batched, on a bounded server; a short
    exchange that never reaches the bound answers exactly as an unbounded server does."""
    bounded = start_server(tiny_llama, engine={"max_kv_size": BOUND, "max_num_seqs": 8})
    plain = start_server(tiny_llama)
    short = _body("Hi", 8)
    with bounded.client() as c, ThreadPoolExecutor(4) as pool:
        rs = list(
            pool.map(
                lambda b: c.post(CHAT, json=b),
                [_body(LONG, 40), _body(LONG + "again", 40), _body("Hello", 40), short],
            )
        )
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    long_usage = rs[0].json()["usage"]
    assert long_usage["prompt_tokens"] > BOUND and long_usage["completion_tokens"] == 40
    with plain.client() as c:
        ref = c.post(CHAT, json=short)
    assert ref.json()["usage"]["prompt_tokens"] + 8 <= BOUND  # the bound never rotated it
    assert rs[3].json()["choices"][0]["message"] == ref.json()["choices"][0]["message"]
    view = _loaded(bounded, "tiny-llama")
    assert view["options"]["max_kv_size"] == BOUND and view["max_batch_size_seen"] >= 2


def test_kv_bits_on_a_text_model_is_a_load_error_naming_the_key(
    start_server, tmp_path, tiny_llama, tiny_qwen2
):
    """Set per model: that model's load fails with a 500 that says why and where; the other
    models serve on."""
    install_into_store(tmp_path / "models", "tiny-qwen2", tiny_qwen2)
    srv = start_server(tiny_llama, models={"options": {"tiny-qwen2": {"kv_bits": 6}}})
    with srv.client() as c:
        bad = c.post(CHAT, json=_body("Hi", 4, model="tiny-qwen2"))
        good = c.post(CHAT, json=_body("Hi", 4))
    assert bad.status_code == 500, bad.text
    err = bad.json()["error"]
    assert err["code"] == "model_load_failed"
    assert "models.options.tiny-qwen2.kv_bits" in err["message"]
    assert "text models take kv_bits 4 or 8" in err["message"]
    assert good.status_code == 200


def test_engine_kv_bits_refuses_a_text_model_and_says_where_it_was_set(tmp_path, tiny_llama):
    """engine.kv_bits applies to every model: a text model cannot take 6, and its load
    fails (for the default model that is the start: the core's pinned loads stop it)."""
    from mlxd.core.errors import ModelLoadError
    from mlxd.engines.registry import create_engine

    settings = make_settings(tmp_path, tiny_llama, engine={"kv_bits": 6})
    with pytest.raises(
        ModelLoadError,
        match=r"engine\.kv_bits is 6 \(uniform\), but 'tiny-llama' is a text model",
    ):
        create_engine("chat", "tiny-llama", tiny_llama, settings)


def test_per_model_options_apply_to_that_model_only(start_server, tmp_path, tiny_llama, tiny_qwen2):
    """models.options.<name> over engine.*, for that model alone (engines/options.py)."""
    install_into_store(tmp_path / "models", "tiny-qwen2", tiny_qwen2)
    srv = start_server(
        tiny_llama,
        engine={"max_kv_size": 256},
        models={"options": {"tiny-qwen2": {"max_kv_size": BOUND}}},
    )
    with srv.client() as c:
        r = c.post(CHAT, json=_body("Hi", 4, model="tiny-qwen2"))
    assert r.status_code == 200, r.text
    assert _loaded(srv, "tiny-qwen2")["options"]["max_kv_size"] == BOUND
    assert _loaded(srv, "tiny-llama")["options"]["max_kv_size"] == 256
