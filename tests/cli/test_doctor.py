"""`mlxd doctor` and the BLAS preload, as a user sees them."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def _doctor(env_extra: dict) -> dict:
    env = dict(os.environ, **env_extra)
    p = subprocess.run(
        [sys.executable, "-m", "mlxd", "doctor", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_doctor_reports_backend_blas_and_a_measurement(tmp_path):
    r = _doctor({"MLXD_HOME": str(tmp_path)})
    assert r["backend"] in ("cpu", "metal", "cuda")
    assert r["float32_matmul_gflops"] > 0
    assert r["blas"]["description"]
    assert r["home"] == str(tmp_path)


def test_blas_off_keeps_the_reference_blas(tmp_path):
    r = _doctor({"MLXD_HOME": str(tmp_path), "MLXD_BLAS": "off"})
    if sys.platform == "linux":
        assert r["blas"]["loaded"] is False and "disabled" in r["blas"]["description"]


def test_blas_named_library_that_does_not_exist_falls_back_with_a_hint(tmp_path):
    r = _doctor({"MLXD_HOME": str(tmp_path), "MLXD_BLAS": str(tmp_path / "libnope.so")})
    if sys.platform == "linux":
        assert r["blas"]["loaded"] is False
        assert "libopenblas0-pthread" in r["blas"]["description"]
