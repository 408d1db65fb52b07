"""LoRA adapters for chat models: `--adapter` (models.adapter_path) on the default model and
models.options.<name>.adapter_path on others, loaded through mlx-lm's own adapter format."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest
from conftest import make_settings
from mlx.utils import tree_flatten

CHAT = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8, "temperature": 0}


def make_lora_adapter(model_dir: Path, out: Path, *, rank: int = 4, seed: int = 0) -> Path:
    """An adapter as mlx-lm's trainer saves one (adapter_config.json + adapters.safetensors),
    with non-zero random ``lora_b`` so the adapted model really answers differently."""
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    model, _ = load(str(model_dir))
    params = {"rank": rank, "scale": 20.0, "dropout": 0.0}
    num_layers = len(model.layers)
    model.freeze()  # as mlx-lm's trainer does: only the LoRA matrices are trainable
    linear_to_lora_layers(model, num_layers, params)
    rng = np.random.default_rng(seed)
    weights = {
        k: mx.array(rng.normal(size=v.shape).astype(np.float32) * 0.5)
        if k.endswith("lora_b")
        else v
        for k, v in tree_flatten(model.trainable_parameters())
    }
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    (out / "adapter_config.json").write_text(
        json.dumps({"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": params})
    )
    return out


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
