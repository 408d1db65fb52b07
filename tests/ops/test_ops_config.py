"""`mlxd config`: effective values with their sources, the generated example, the path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml


def _env(tmp_path: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXD_")}
    env.update(MLXD_HOME=str(tmp_path / "home"), **extra)
    return env


def mlxd(*args, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlxd", *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_example_round_trips_to_the_defaults(tmp_path, monkeypatch):
    r = mlxd("config", "--example", env=_env(tmp_path))
    assert r.returncode == 0, r.stderr
    path = tmp_path / "example.yaml"
    path.write_text(r.stdout)
    for k in list(os.environ):
        if k.startswith("MLXD_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("MLXD_HOME", str(tmp_path / "home"))
    from mlxd.config import Settings, load_settings

    assert load_settings(path) == Settings()
    # every setting is in it, each with its description as a comment (no drift possible)
    data = yaml.safe_load(r.stdout)
    for section, field in Settings.model_fields.items():
        assert set(data[section]) == set(field.annotation.model_fields), section
        for key, sub in field.annotation.model_fields.items():
            if sub.description:
                first = sub.description.split()[:3]
                assert " ".join(first) in r.stdout.replace("\n  # ", " "), (section, key)
    assert "# for example:" in r.stdout and "sk-change-me" in r.stdout


def test_config_shows_each_values_source(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "server:\n  port: 9100\nengine:\n  max_num_seqs: 7\n"
        "security:\n  api_keys:\n    - {key: sk-very-secret, name: ops}\n"
    )
    env = _env(tmp_path, MLXD_LOG__LEVEL="debug", MLXD_ENGINE__MAX_NUM_SEQS="9", MLXD_PRELOAD="a,b")
    r = mlxd("config", "--config", cfg, "--host", "0.0.0.0", "--json", env=env)
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    s = data["settings"]
    assert data["config_file"] == str(cfg) and data["config_file_exists"]
    assert s["server"]["host"] == {"value": "0.0.0.0", "source": "flag"}
    assert s["server"]["port"] == {"value": 9100, "source": "file"}
    assert s["engine"]["max_num_seqs"] == {"value": 9, "source": "env MLXD_ENGINE__MAX_NUM_SEQS"}
    assert s["log"]["level"]["source"] == "env MLXD_LOG__LEVEL"
    assert s["models"]["preload"] == {"value": ["a", "b"], "source": "env MLXD_PRELOAD"}
    assert s["engine"]["prefill_step_size"]["source"] == "default"
    assert s["security"]["api_keys"]["value"][0]["key"] == "***"
    assert "sk-very-secret" not in r.stdout

    r = mlxd("config", "--config", cfg, env=env)
    assert r.returncode == 0
    lines, section = {}, ""
    for line in r.stdout.splitlines():
        if line and not line.startswith((" ", "#")):
            section = line.rstrip(":")
        elif line.startswith("  "):
            lines[f"{section}.{line.split(':')[0].strip()}"] = line.rstrip()
    assert lines["server.port"].endswith("# file")
    assert lines["server.host"].endswith("# default")
    assert lines["log.level"].endswith("# env MLXD_LOG__LEVEL")
    assert "sk-very-secret" not in r.stdout


def test_config_path_and_errors(tmp_path):
    env = _env(tmp_path)
    r = mlxd("config", "--path", env=env)
    assert r.returncode == 0 and r.stdout.strip() == str(tmp_path / "home" / "config.yaml")
    r = mlxd("config", "--path", "--config", tmp_path / "x.yaml", env=env)
    assert r.stdout.strip() == str((tmp_path / "x.yaml").resolve())
    bad = tmp_path / "bad.yaml"
    bad.write_text("security:\n  max_body_bytes: lots\n")
    r = mlxd("config", "--config", bad, env=env)
    assert r.returncode == 2 and "security.max_body_bytes" in r.stderr
    assert "Traceback" not in r.stderr
