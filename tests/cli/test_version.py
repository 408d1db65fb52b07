"""One version: written once (``mlxd.__version__``), read by the packaging and the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tomllib

from mlxd import __version__

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_takes_its_version_from_the_package():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in meta["project"] and "version" in meta["project"]["dynamic"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "mlxd.__version__"}


def test_both_cli_spellings_print_the_version(tmp_path):
    env = dict(os.environ, MLXD_HOME=str(tmp_path / "home"))
    for args in (["--version"], ["version"]):
        p = subprocess.run(
            [sys.executable, "-m", "mlxd", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert p.returncode == 0, p.stderr
        assert p.stdout.strip() == __version__
