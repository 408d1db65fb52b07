"""Models in the local Hugging Face cache are listed and served in place, with no network.

The cache is a fake laid out as huggingface_hub writes it: ``models--ORG--NAME`` with
content-addressed ``blobs/``, ``snapshots/<rev>/`` of links into them, and ``refs/main``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from fixtures.tiny_models import make_tiny_chat_model
from mlx_lm import generate
from mlx_lm.utils import load as mlx_lm_load

from mlxd.config import ModelSettings
from mlxd.core.errors import ModelNotFound
from mlxd.store.hf_cache import find_cached_model, hf_hub_cache, list_cached_models
from mlxd.store.local import ModelStore
from mlxd.store.pull import ensure_model

REV = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny", "qwen2")


def cache_repo(
    cache: Path,
    repo: str,
    files: dict[str, bytes],
    *,
    rev: str = REV,
    ref: bool = True,
    kind: str = "models",
) -> Path:
    """Lay ``files`` out as a huggingface_hub cache entry; return the snapshot directory."""
    repo_dir = cache / f"{kind}--{repo.replace('/', '--')}"
    snap = repo_dir / "snapshots" / rev
    for rel, data in files.items():
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref:
        (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs" / "main").write_text(rev)
    return snap


@pytest.fixture()
def cache(tmp_path, monkeypatch, tiny) -> Path:
    root = tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    model_files = {p.name: p.read_bytes() for p in tiny.iterdir() if p.is_file()}
    cache_repo(root, "acme/tiny-chat", model_files)
    # not servable: no safetensors / only a dataset / a download missing its weights
    cache_repo(root, "acme/torch-only", {"config.json": b"{}", "pytorch_model.bin": b"x"})
    cache_repo(root, "acme/some-data", {"data.json": b"{}"}, kind="datasets")
    partial = cache_repo(root, "acme/partial", {"config.json": model_files["config.json"]})
    (partial / "model.safetensors").symlink_to("../../blobs/missing")  # dangling
    return root


def test_cache_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hf_hub_cache() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert hf_hub_cache() == tmp_path / "elsewhere"


def test_lists_only_loadable_model_snapshots(cache, tiny):
    models = list_cached_models()
    assert [m.name for m in models] == ["acme/tiny-chat"]
    m = models[0]
    assert m.kind == "chat" and m.revision == REV
    assert m.path == cache / "models--acme--tiny-chat" / "snapshots" / REV
    assert m.size == sum(p.stat().st_size for p in tiny.iterdir() if p.is_file())
    assert list_cached_models(cache / "nowhere") == []


def test_find_prefers_refs_main_and_rejects_odd_names(cache, tiny):
    old = cache_repo(cache, "acme/tiny-chat", {"config.json": b"{}"}, rev="f" * 40, ref=False)
    assert old.is_dir()
    found = find_cached_model("acme/tiny-chat")
    assert found is not None and found.revision == REV  # refs/main wins over other revisions
    for bad in ("acme", "acme/../x", "a/b/c", "/etc", "acme/partial", "acme/torch-only"):
        assert find_cached_model(bad) is None, bad


def test_ensure_model_serves_the_cache_without_download(cache, tmp_path):
    store = ModelStore(tmp_path / "models")
    off = ModelSettings(auto_download=False, auto_download_defaults=False)
    path = ensure_model(store, "acme/tiny-chat", off)
    assert path == find_cached_model("acme/tiny-chat").path
    assert store.list() == []  # nothing copied into the store
    assert ensure_model(store, "hf:acme/tiny-chat", off) == path
    with pytest.raises(ModelNotFound, match="mlxd pull"):
        ensure_model(store, "acme/not-cached", off)
    model, tok = mlx_lm_load(str(path))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert generate(model, tok, prompt, max_tokens=4)  # the tiny model always writes 4 tokens


def test_server_lists_and_serves_the_cache_without_a_pull(cache, start_server, tiny):
    """mlx-vlm's /models lists the local Hugging Face cache; a chat names a cached repo id
    and the model is served in place (auto_download is off: nothing is pulled)."""
    import httpx

    srv = start_server(tiny)
    for path in ("/models", "/v1/models"):
        ids = [m["id"] for m in httpx.get(srv.url + path, timeout=10).json()["data"]]
        assert "acme/tiny-chat" in ids and "acme/torch-only" not in ids, (path, ids)
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        timeout=60,
        json={
            "model": "acme/tiny-chat",
            "max_tokens": 3,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "acme/tiny-chat"
    assert not (srv.settings.models_dir / "acme").exists()  # not copied into the store
    tags = httpx.get(srv.url + "/api/tags", timeout=10).json()["models"]
    assert "acme/tiny-chat" in [t["name"] for t in tags]
