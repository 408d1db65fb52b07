"""The suite's own guard: every test runs in a temporary home, and a test that writes into
the real one fails. Checked by running pytest on a small test file with this conftest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent

INNER = """
import os
from pathlib import Path


def test_a_home_of_its_own():
    home = Path(os.environ["HOME"])
    assert home != Path(os.environ["REAL_HOME"])
    assert os.environ["MLXD_HOME"] == str(home / ".mlxd")
    assert all(os.environ[k].startswith(str(home)) for k in (
        "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "HF_HOME"))
    (home / ".mlxd" / "models").mkdir(parents=True)  # its own: allowed


def test_writes_into_the_real_home():
    (Path(os.environ["REAL_HOME"]) / ".mlxd" / "models").mkdir(parents=True)
"""


def test_a_test_that_writes_into_the_real_home_fails(tmp_path, _own_home):
    """The inner run's "real" home is this test's home: one inner test keeps to its own
    home and passes, the other writes below the real ~/.mlxd and fails, named."""
    (tmp_path / "test_inner.py").write_text(INNER)
    env = dict(
        os.environ,
        REAL_HOME=str(_own_home),
        PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    )
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "conftest",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            "-p",
            "no:xdist",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_inner.py"),
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    # the writer's call passes and its teardown errs; the run's end says so again
    assert "2 passed, 1 error" in out, out
    assert "ERROR at teardown of test_writes_into_the_real_home" in out, out
    assert "ERROR at teardown of test_a_home_of_its_own" not in out, out
    real = _own_home / ".mlxd"
    assert f"changed the real home: ['{real} (exists)', '{real / 'models'}']" in out, out
    assert "the test run changed the real home" in out, out
