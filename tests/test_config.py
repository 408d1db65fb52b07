"""Settings precedence: defaults < YAML file < MLXD_* environment < explicit flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxd.config import ConfigError, load_settings


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXD_HOME", str(tmp_path / "home"))
    for k in list(__import__("os").environ):
        if k.startswith("MLXD_") and k != "MLXD_HOME":
            monkeypatch.delenv(k)


def test_defaults(tmp_path):
    s = load_settings()
    assert s.server.host == "127.0.0.1" and s.server.port == 8000
    assert s.models.default == "smollm2-135m-instruct"
    assert s.models_dir == tmp_path / "home" / "models"
    assert s.engine.max_num_seqs == "auto" and s.engine.max_queued_requests > 0
    assert s.log.level == "info" and s.log.format == "text"


def test_precedence_file_env_flags(tmp_path, monkeypatch):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "server:\n  port: 9001\n  host: 0.0.0.0\nengine:\n  max_num_seqs: 4\nlog:\n  format: json\n"
    )
    s = load_settings(cfg)
    assert (s.server.port, s.server.host, s.engine.max_num_seqs) == (9001, "0.0.0.0", 4)
    monkeypatch.setenv("MLXD_SERVER__PORT", "9002")
    monkeypatch.setenv("MLXD_ENGINE__PREFILL_STEP_SIZE", "128")
    s = load_settings(cfg)
    assert s.server.port == 9002 and s.server.host == "0.0.0.0"  # env wins, file fills in
    assert s.engine.prefill_step_size == 128 and s.engine.max_num_seqs == 4
    s = load_settings(cfg, {"server": {"port": 9003, "host": None}})
    assert s.server.port == 9003 and s.server.host == "0.0.0.0"  # None flag masks nothing
    assert s.log.format == "json"


def test_home_config_file_is_read(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.yaml").write_text("models:\n  default: my-model\n  preload: [a, b]\n")
    s = load_settings()
    assert s.models.default == "my-model" and s.models.preload == ["a", "b"]


@pytest.mark.parametrize(
    ("yaml_text", "needle"),
    [
        ("server:\n  prot: 1\n", "unknown key 'server.prot'"),
        ("nonsense: 1\n", "unknown key 'nonsense'"),
        ("server:\n  port: many\n", "'server.port'"),
        ("engine:\n  max_num_seqs: 0\n", "'engine.max_num_seqs'"),
        ("log:\n  level: loud\n", "'log.level'"),
        ("- a\n- b\n", "must be a mapping"),
        ("server: [\n", "not valid YAML"),
    ],
)
def test_bad_file_is_a_clear_error_naming_the_key(tmp_path, yaml_text, needle):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml_text)
    with pytest.raises(ConfigError) as info:
        load_settings(cfg)
    assert needle in str(info.value)
    assert str(cfg) in str(info.value)


def test_bad_env_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("MLXD_SERVER__PORT", "eighty")
    with pytest.raises(ConfigError, match="server.port"):
        load_settings()


def test_missing_explicit_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_settings(Path(tmp_path / "nope.yaml"))


def test_max_num_seqs_auto_or_a_number_from_yaml_env_and_flags(tmp_path, monkeypatch):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "engine:\n  max_num_seqs: auto\n  auto_seq_context: 2048\nmodels:\n"
        "  options:\n    big:\n      max_num_seqs: 12\n"
        "    small:\n      max_num_seqs: auto\n"
    )
    s = load_settings(cfg)
    assert (s.engine.max_num_seqs, s.engine.auto_seq_context) == ("auto", 2048)
    assert s.models.options["big"].max_num_seqs == 12
    assert s.models.options["small"].max_num_seqs == "auto"
    assert s.models.options.get("other") is None
    monkeypatch.setenv("MLXD_ENGINE__MAX_NUM_SEQS", "64")
    assert load_settings(cfg).engine.max_num_seqs == 64
    monkeypatch.setenv("MLXD_ENGINE__MAX_NUM_SEQS", "auto")
    assert load_settings().engine.max_num_seqs == "auto"
    assert load_settings(None, {"engine": {"max_num_seqs": "48"}}).engine.max_num_seqs == 48
    for bad in ("lots", "0", "-3", "2.5"):
        monkeypatch.setenv("MLXD_ENGINE__MAX_NUM_SEQS", bad)
        with pytest.raises(ConfigError, match=r"engine\.max_num_seqs.*'auto' or an integer"):
            load_settings()
    cfg.write_text("models:\n  options:\n    big:\n      max_num_seqs: 0\n")
    with pytest.raises(ConfigError, match=r"models\.options\.big\.max_num_seqs"):
        load_settings(cfg)


def test_flat_preload_env(monkeypatch):
    monkeypatch.setenv("MLXD_PRELOAD", "a, b ,c")
    assert load_settings().models.preload == ["a", "b", "c"]
    s = load_settings(None, {"models": {"preload": ["x"]}})
    assert s.models.preload == ["x"]  # flags still win


def test_speculative_settings_from_env_and_flags(monkeypatch):
    default = load_settings().engine
    assert (default.speculative, default.speculative_policy) == ("auto", "cost")
    assert default.speculative_max_batch == 0  # no cap
    monkeypatch.setenv("MLXD_ENGINE__SPECULATIVE", "prompt-lookup")
    monkeypatch.setenv("MLXD_ENGINE__SPECULATIVE_MAX_BATCH", "4")
    monkeypatch.setenv("MLXD_ENGINE__SPECULATIVE_POLICY", "always")
    s = load_settings()
    assert (s.engine.speculative, s.engine.speculative_max_batch) == ("prompt-lookup", 4)
    assert s.engine.speculative_policy == "always"
    s = load_settings(None, {"engine": {"speculative": "draft", "draft_model": "small"}})
    assert (s.engine.speculative, s.engine.draft_model) == ("draft", "small")
    monkeypatch.setenv("MLXD_ENGINE__SPECULATIVE", "medusa")
    with pytest.raises(ConfigError, match="engine.speculative"):
        load_settings()


@pytest.mark.parametrize("word", ["off", "no", "false", "Off", '"off"'])
def test_yaml_off_means_off_for_keys_that_take_off(tmp_path, word):
    """YAML 1.1 reads a bare ``off`` as false; speculative and blas take it as 'off'."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"engine:\n  speculative: {word}\nbackend:\n  blas: {word}\n")
    s = load_settings(cfg)
    assert s.engine.speculative == "off" and s.backend.blas == "off"


def test_yaml_on_is_still_refused_for_speculative(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("engine:\n  speculative: on\n")
    with pytest.raises(ConfigError, match="'engine.speculative'.*'prompt-lookup'"):
        load_settings(cfg)


def test_the_step_budget_is_auto_a_number_or_zero(monkeypatch):
    assert load_settings().engine.max_step_tokens == "auto"
    monkeypatch.setenv("MLXD_ENGINE__MAX_STEP_TOKENS", "1024")
    assert load_settings().engine.max_step_tokens == 1024
    monkeypatch.setenv("MLXD_ENGINE__MAX_STEP_TOKENS", "0")
    assert load_settings().engine.max_step_tokens == 0
    for bad in ("-1", "lots"):
        monkeypatch.setenv("MLXD_ENGINE__MAX_STEP_TOKENS", bad)
        with pytest.raises(ConfigError, match="engine.max_step_tokens"):
            load_settings()
