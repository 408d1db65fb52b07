"""backend.cudnn_attention reaches the engine-core process as the MLX switch it stands for.

MLX reads MLX_CUDA_USE_CUDNN_SDPA once per process, so the supervisor must put it in the
core's environment at spawn; /proc/<pid>/environ shows what a process was started with.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/<pid>/environ"
)


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode().partition("=")[::2] for kv in raw if b"=" in kv)


def test_cudnn_attention_is_off_in_the_core_by_default(server):
    assert server.settings.backend.cudnn_attention is False
    assert _environ(server.core_pid)["MLX_CUDA_USE_CUDNN_SDPA"] == "0"
    # the server answers as usual with the switch set
    r = server.client().post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200


def test_cudnn_attention_on_reaches_the_core(start_server, tiny_llama, monkeypatch):
    # the setting decides, whatever the server process itself was started with
    monkeypatch.setenv("MLX_CUDA_USE_CUDNN_SDPA", "0")
    srv = start_server(tiny_llama, backend={"cudnn_attention": True})
    assert _environ(srv.core_pid)["MLX_CUDA_USE_CUDNN_SDPA"] == "1"
    assert srv.health()["status"] == "ok"


def test_cudnn_attention_from_the_environment(monkeypatch, tmp_path):
    from mlxd.config import load_settings

    monkeypatch.setenv("MLXD_HOME", str(tmp_path))
    monkeypatch.setenv("MLXD_BACKEND__CUDNN_ATTENTION", "true")
    assert load_settings().backend.cudnn_attention is True
