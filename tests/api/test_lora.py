"""LoRA adapters for chat models: `--adapter` (models.adapter_path) on the default model and
models.options.<name>.adapter_path on others, loaded through mlx-lm's own adapter format."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from conftest import make_settings
from fixtures.lora import make_lora_adapter

CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def adapter(tiny_llama, tmp_path_factory) -> Path:
    return make_lora_adapter(tiny_llama, tmp_path_factory.mktemp("lora") / "adapter")


def test_chat_model_serves_with_a_lora_adapter(start_server, tiny_llama, adapter, tmp_path):
    plain = start_server(tiny_llama)
    base = httpx.post(plain.url + "/v1/chat/completions", json=CHAT, timeout=60)
    assert base.status_code == 200
    tuned_srv = start_server(tiny_llama, models={"adapter_path": str(adapter)})
    tuned = httpx.post(tuned_srv.url + "/v1/chat/completions", json=CHAT, timeout=60)
    assert tuned.status_code == 200, tuned.text
    st = {m["name"]: m for m in tuned_srv.health()["models"]}["tiny-llama"]
    assert st["adapter_path"] == str(adapter)
    assert tuned.json()["choices"][0]["message"] != base.json()["choices"][0]["message"]


def test_a_missing_adapter_is_a_clear_error_naming_the_model(tiny_llama, tmp_path):
    from conftest import LiveServer

    srv = LiveServer(
        make_settings(tmp_path, tiny_llama, models={"adapter_path": str(tmp_path / "nope")})
    )
    with pytest.raises(RuntimeError, match="server failed to start"):
        srv.start()
    assert srv.exit_code == 3  # uvicorn's startup failure, not a crash of the thread
    assert "adapter for 'tiny-llama' not found" in srv.runtime.cores.startup_error
    assert srv.runtime.supervisors[0]._proc.poll() is not None  # no engine core left behind
    srv.stop()
