"""The store never writes outside its root and never shows a half-written model."""

from __future__ import annotations

import json

import pytest

from mlxd.config import ModelSettings
from mlxd.core.errors import InvalidRequest, ModelNotFound
from mlxd.store.local import ModelStore
from mlxd.store.names import dir_name, validate_name
from mlxd.store.pull import ensure_model


@pytest.mark.parametrize(
    "name", ["smollm2-135m-instruct", "org/model-1.5B", "llama3:8b", "Qwen2.5-0.5B-Instruct-4bit"]
)
def test_valid_names(name):
    assert validate_name(name) == name
    assert "/" not in dir_name(name) and ".." not in dir_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "../x",
        "..",
        "/etc/passwd",
        "a/../../b",
        "a\\b",
        "a\x00b",
        "",
        ".hidden",
        "a/b/c",
        "x/..",
        "-rf",
    ],
)
def test_traversal_names_rejected(name):
    with pytest.raises(InvalidRequest):
        validate_name(name)


def _write_model(d):
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (d / "model.safetensors").write_bytes(b"\0" * 16)
    return {"format": "mlx"}


def test_install_is_atomic_and_writes_a_manifest(tmp_path):
    store = ModelStore(tmp_path / "models")
    path = store.install("m1", _write_model, kind="chat", source="test")
    assert store.get("m1") == path
    m = store.manifest("m1")
    assert m["name"] == "m1" and m["kind"] == "chat" and m["source"] == "test"
    assert m["size"] > 0 and m["digest"].startswith("sha256:") and m["created"]
    assert [e["name"] for e in store.list()] == ["m1"]


def test_failed_install_leaves_nothing(tmp_path):
    store = ModelStore(tmp_path / "models")

    def broken(d):
        (d / "config.json").write_text("{}")
        raise RuntimeError("killed halfway")

    with pytest.raises(RuntimeError):
        store.install("m2", broken, kind="chat", source="test")
    assert store.get("m2") is None
    assert list((tmp_path / "models").iterdir()) == []


def test_leftover_temp_dirs_are_cleaned(tmp_path):
    store = ModelStore(tmp_path / "models")
    leftover = tmp_path / "models" / ".tmp-deadbeef"
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{}")
    assert store.list() == []
    store.clean_temp()
    assert not leftover.exists()


def test_unknown_model_is_not_found(tmp_path):
    with pytest.raises(ModelNotFound):
        ensure_model(ModelStore(tmp_path), "no-such-model", ModelSettings())


def test_builtin_alias_without_auto_download_is_not_found(tmp_path):
    with pytest.raises(ModelNotFound, match="mlxd pull"):
        settings = ModelSettings(auto_download=False, auto_download_defaults=False)
        ensure_model(ModelStore(tmp_path), "smollm2-135m-instruct", settings)
