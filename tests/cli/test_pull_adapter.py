"""`mlxd pull` of LoRA adapters (mlx-lm's directories and PEFT's) into the store: registered
on their base model, listed, served by name by a running server at once in every dialect
(the same greedy text as a server started with `--adapter`), removed by `mlxd rm`; and PEFT
directories loaded at run time through `POST /v1/load_lora_adapter`."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import httpx
import pytest
from conftest import LiveServer, cli_env, make_settings, run_mlxd
from fixtures.lora import MSG, chat, make_lora_adapter, make_peft_adapter, replies_alone, reply_text


def error_line(p: subprocess.CompletedProcess) -> str:
    return p.stderr.strip().splitlines()[-1]


def _ollama(url: str, route: str, model: str) -> httpx.Response:
    body: dict = {"model": model, "stream": False, "options": {"temperature": 0, "num_predict": 8}}
    if route == "chat":
        body["messages"] = MSG
    else:
        body["prompt"] = MSG[0]["content"]
    return httpx.post(f"{url}/api/{route}", json=body, timeout=120)


@pytest.fixture(scope="module")
def loras(tiny_llama, tmp_path_factory) -> dict[str, Path]:
    """sql-helper in mlx-lm's layout and the same weights in PEFT's; beta another adapter."""
    root = tmp_path_factory.mktemp("adapters")
    mlx = make_lora_adapter(tiny_llama, root / "sql-helper", seed=0)
    return {
        "mlx": mlx,
        "peft": make_peft_adapter(mlx, root / "sql-helper-peft", base=str(tiny_llama)),
        "beta": make_lora_adapter(tiny_llama, root / "beta", seed=1),
    }


@pytest.fixture(scope="module")
def expected(tiny_llama, loras, tmp_path_factory) -> dict[str, str]:
    """Greedy replies of servers started with `--adapter` on the mlx-lm directories, and of
    the base alone."""
    out = replies_alone(
        tmp_path_factory, tiny_llama, {"base": None, "mlx": loras["mlx"], "beta": loras["beta"]}
    )
    assert len(set(out.values())) == 3, out  # each adapter really answers differently
    return out


def _registry(home: Path) -> dict:
    f = home / "models" / "lora-adapters.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def test_pulled_adapters_answer_as_their_own_server_in_every_dialect(
    tiny_llama, loras, expected, tmp_path
):
    home = tmp_path / "home"
    env = cli_env(home)
    run_mlxd(env, "pull", str(tiny_llama))
    p = run_mlxd(env, "pull", str(loras["mlx"]), "--base", "tiny-llama")
    assert p.stdout.startswith("sql-helper: adapter of tiny-llama, ")
    # PEFT's config names the directory tiny-llama was pulled from: its base, found
    p = run_mlxd(env, "pull", str(loras["peft"]), "--as", "sql-peft")
    assert p.stdout.startswith("sql-peft: adapter of tiny-llama, ")
    stored = home / "models" / "sql-peft"
    assert sorted(f.name for f in stored.iterdir()) == [
        "adapter_config.json",
        "adapters.safetensors",
        "mlxd.json",
    ]
    cfg = json.loads((stored / "adapter_config.json").read_text())
    assert cfg["fine_tune_type"] == "lora" and cfg["lora_parameters"]["scale"] == 20.0

    rows = {m["name"]: m for m in json.loads(run_mlxd(env, "list", "--json").stdout)}
    assert rows["sql-helper"]["kind"] == rows["sql-peft"]["kind"] == "adapter"
    assert rows["sql-helper"]["base"] == rows["sql-peft"]["base"] == "tiny-llama"
    assert rows["sql-peft"]["format"] == "peft"
    table = run_mlxd(env, "list").stdout.splitlines()
    assert table[0].split() == ["NAME", "KIND", "SIZE", "QUANTIZATION", "MODIFIED", "BASE"]
    assert any(r.split()[:2] == ["sql-peft", "adapter"] and r.endswith("tiny-llama") for r in table)
    shown = json.loads(run_mlxd(env, "show", "sql-peft", "--json").stdout)
    assert shown["manifest"]["base"] == "tiny-llama" and shown["path"] == str(stored)
    assert {e["base"] for e in _registry(home).values()} == {"tiny-llama"}

    srv = LiveServer(make_settings(home, "tiny-llama")).start()
    try:
        url = srv.url
        assert reply_text(chat(url, "sql-helper")) == expected["mlx"]
        assert reply_text(chat(url, "sql-peft")) == expected["mlx"]
        assert reply_text(chat(url, "tiny-llama:sql-peft")) == expected["mlx"]
        assert reply_text(chat(url, "tiny-llama")) == expected["base"]
        r = _ollama(url, "chat", "sql-peft")
        assert r.status_code == 200 and r.json()["message"]["content"] == expected["mlx"], r.text
        r = _ollama(url, "generate", "sql-helper")
        assert r.status_code == 200 and r.json()["response"] == expected["mlx"], r.text
        cards = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
        assert cards["sql-peft"]["parent"] == "tiny-llama" and "parent" not in cards["tiny-llama"]

        # pulled while the server runs: a model name at once, no restart
        run_mlxd(env, "pull", str(loras["beta"]), "--base", "tiny-llama")
        assert reply_text(chat(url, "beta")) == expected["beta"]
        line = error_line(run_mlxd(env, "pull", str(loras["beta"]), "--as", "sql-peft", ok=False))
        assert "'sql-peft' already exists" in line, line
        assert reply_text(chat(url, "sql-peft")) == expected["mlx"]

        run_mlxd(env, "rm", "sql-helper")
        assert "sql-helper" not in _registry(home) and not (home / "models" / "sql-helper").exists()
        r = chat(url, "sql-helper")
        assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
        r = _ollama(url, "chat", "sql-helper")
        assert r.status_code == 404 and isinstance(r.json()["error"], str), r.text
        assert "sql-helper" not in {m["id"] for m in httpx.get(url + "/v1/models").json()["data"]}
        assert reply_text(chat(url, "sql-peft")) == expected["mlx"]  # the others still serve

        # the name again, other weights: the core reads the new files, not the ones it held
        run_mlxd(env, "pull", str(loras["beta"]), "--as", "sql-helper", "--base", "tiny-llama")
        assert reply_text(chat(url, "sql-helper")) == expected["beta"]
    finally:
        srv.stop()


def _peft(loras: dict[str, Path], root: Path, name: str, **config: object) -> Path:
    return make_peft_adapter(loras["mlx"], root / name, base="somewhere/else", **config)


def _neither(d: Path) -> Path:
    d.mkdir()
    (d / "README.md").write_text("neither a model nor an adapter\n")
    return d


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no-base", "pass --base NAME"),
        ("unknown-base", "--base 'nosuch' is not a model in the store"),
        ("dora", "DoRA (use_dora: true)"),
        ("rank-pattern", "rank_pattern"),
        ("modules-to-save", "modules_to_save"),
        ("neither", "nor a LoRA adapter"),
        ("model-as-adapter", "not a LoRA adapter directory"),
    ],
)
def test_bad_adapters_are_refused_and_change_nothing(tiny_llama, loras, tmp_path, case, message):
    home = tmp_path / "home"
    env = cli_env(home)
    run_mlxd(env, "pull", str(tiny_llama))
    before = sorted(p.name for p in (home / "models").iterdir())
    args = {
        "no-base": [str(loras["mlx"])],
        "unknown-base": [str(loras["mlx"]), "--base", "nosuch"],
        "dora": [str(_peft(loras, tmp_path, "dora", use_dora=True)), "--base", "tiny-llama"],
        "rank-pattern": [str(_peft(loras, tmp_path, "rp", rank_pattern={"q_proj": 8}))],
        "modules-to-save": [str(_peft(loras, tmp_path, "ms", modules_to_save=["lm_head"]))],
        "neither": [str(_neither(tmp_path / "notes"))],
        "model-as-adapter": [str(tiny_llama), "--type", "adapter", "--as", "x"],
    }[case]
    line = error_line(run_mlxd(env, "pull", *args, ok=False))
    assert line.startswith("mlxd: ") and message in line, line
    assert sorted(p.name for p in (home / "models").iterdir()) == before
    assert [m["name"] for m in json.loads(run_mlxd(env, "list", "--json").stdout)] == ["tiny-llama"]
    assert _registry(home) == {}


def test_a_peft_directory_loads_at_run_time(tiny_llama, loras, expected, start_server, tmp_path):
    srv = start_server(tiny_llama)

    def load(name: str, path: Path) -> httpx.Response:
        return httpx.post(
            srv.url + "/v1/load_lora_adapter",
            json={"lora_name": name, "lora_path": str(path)},
            timeout=120,
        )

    r = load("sql-peft", loras["peft"])
    assert r.status_code == 200, r.text
    assert reply_text(chat(srv.url, "sql-peft")) == expected["mlx"]
    # rsLoRA scales by alpha / sqrt(r): this alpha gives mlx-lm's scale of 20 again
    rs = _peft(loras, tmp_path, "rs", use_rslora=True, lora_alpha=20.0 * math.sqrt(4))
    assert load("rs", rs).status_code == 200
    assert reply_text(chat(srv.url, "rs")) == expected["mlx"]

    for name, config, feature in [
        ("dora", {"use_dora": True}, "DoRA"),
        ("alpha-pattern", {"alpha_pattern": {"q_proj": 4}}, "alpha_pattern"),
        ("saved", {"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ("bias", {"bias": "all"}, "bias: 'all'"),
    ]:
        r = load(name, _peft(loras, tmp_path, name, **config))
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert feature in err["message"] and err["param"] == "lora_path", err
    names = {m["id"] for m in httpx.get(srv.url + "/v1/models").json()["data"]}
    assert names >= {"sql-peft", "rs"} and not names & {"dora", "alpha-pattern", "saved", "bias"}


def test_the_base_may_be_named_by_the_config_or_be_a_configured_directory(
    tiny_llama, loras, tmp_path
):
    """mlx-lm's ``model`` key naming a store entry is the base; so may ``--base`` name the
    default model served from a directory (models.default) that is not in the store."""
    home = tmp_path / "home"
    env = cli_env(home)
    served = dict(env, MLXD_MODELS__DEFAULT=str(tiny_llama))
    p = run_mlxd(served, "pull", str(loras["mlx"]), "--base", "tiny-llama")
    assert p.stdout.startswith("sql-helper: adapter of tiny-llama, ")
    assert _registry(home)["sql-helper"]["base"] == "tiny-llama"

    named = tmp_path / "named"
    named.mkdir()
    (named / "adapters.safetensors").write_bytes(
        (loras["mlx"] / "adapters.safetensors").read_bytes()
    )
    cfg = json.loads((loras["mlx"] / "adapter_config.json").read_text())
    (named / "adapter_config.json").write_text(json.dumps({**cfg, "model": "tiny-llama"}))
    line = error_line(run_mlxd(env, "pull", str(named), ok=False))
    assert "its config names 'tiny-llama', which is not in the store" in line, line
    run_mlxd(env, "pull", str(tiny_llama))
    p = run_mlxd(env, "pull", str(named))
    assert p.stdout.startswith("named: adapter of tiny-llama, ")


def test_a_pulled_peft_adapter_is_mlx_lms_format(
    tiny_llama, loras, expected, tmp_path, start_server
):
    """The store holds PEFT adapters converted: mlx-lm's own loader (``--adapter``) reads
    the stored directory and answers as with the original mlx-lm adapter."""
    home = tmp_path / "home"
    env = cli_env(home)
    run_mlxd(env, "pull", str(tiny_llama))
    run_mlxd(env, "pull", str(loras["peft"]))
    stored = home / "models" / "sql-helper-peft"
    srv = start_server(tiny_llama, models={"adapter_path": str(stored)})
    assert reply_text(chat(srv.url, "tiny-llama")) == expected["mlx"]
