"""The pre-commit hooks (.pre-commit-config.yaml) work offline: local hooks whose commands
are the venv's ruff, run here on a file as pre-commit would run them."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
VENV_RUFF = ".venv/bin/ruff"  # where scripts/test.sh installs it


def hooks() -> dict[str, dict]:
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    assert [r["repo"] for r in config["repos"]] == ["local"]  # nothing fetched
    return {h["id"]: h for r in config["repos"] for h in r["hooks"]}


def run_hook(hook: dict, file: Path) -> subprocess.CompletedProcess:
    """The hook's command on ``file``, with the ruff of the running environment standing in
    for ./.venv's (the same package from the `test` extra)."""
    argv = shlex.split(hook["entry"])
    assert argv[0] == VENV_RUFF and hook["language"] == "system"
    argv[0] = str(Path(sys.executable).parent / "ruff")
    return subprocess.run([*argv, str(file)], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_the_hooks_are_ruff_check_and_ruff_format():
    assert sorted(hooks()) == ["ruff-check", "ruff-format"]


def test_the_check_hook_fails_on_a_lint_error_and_passes_clean_code(tmp_path):
    hook = hooks()["ruff-check"]
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n")
    p = run_hook(hook, bad)
    assert p.returncode == 1 and "F401" in p.stdout
    bad.write_text("import os\n\nprint(os.sep)\n")
    assert run_hook(hook, bad).returncode == 0


def test_the_format_hook_rewrites_a_file_into_the_project_style(tmp_path):
    ugly = tmp_path / "ugly.py"
    ugly.write_text("x=[1,2]\n")
    p = run_hook(hooks()["ruff-format"], ugly)
    assert p.returncode == 0, p.stderr
    assert ugly.read_text() == "x = [1, 2]\n"
