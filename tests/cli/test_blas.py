"""The BLAS mlxd loads before MLX on Linux CPU, as ``mlxd doctor`` reports it.

The promise checked here: on Linux x86_64, ``pip install '.[cpu]'`` alone brings a fast
BLAS (the ``mkl`` wheel) that mlxd finds and loads; with Debian's OpenBLAS also present
(.ci/run installs it) ``auto`` prefers it, as docs/benchmarks.md's numbers say.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from mlxd import blas

LINUX_X86_64 = sys.platform == "linux" and platform.machine() == "x86_64"
DEBIAN_OPENBLAS = any(p.is_file() for p in blas.candidates()["openblas"])


def doctor(tmp_path: Path, **env_extra: str) -> dict:
    env = dict(os.environ, MLXD_HOME=str(tmp_path), **env_extra)
    env.pop("MKL_THREADING_LAYER", None)
    p = subprocess.run(
        [sys.executable, "-m", "mlxd", "doctor", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.skipif(not LINUX_X86_64, reason="the mkl wheel exists for Linux x86_64 only")
def test_cpu_extra_brings_mkl_and_mlxd_loads_it(tmp_path):
    # the [cpu] extra (scripts/test.sh installs it) must have brought the wheel
    importlib.metadata.distribution("mkl")
    r = doctor(tmp_path, MLXD_BLAS="mkl")
    assert r["blas"]["loaded"] is True and r["blas"]["name"] == "mkl"
    assert Path(r["blas"]["path"]).name.startswith("libmkl_rt.so")
    assert Path(r["blas"]["path"]).is_relative_to(Path(sys.prefix).resolve())
    assert "oneMKL 20" in r["blas"]["description"]  # the library's own version string


@pytest.mark.skipif(not LINUX_X86_64, reason="the mkl wheel exists for Linux x86_64 only")
def test_mkl_uses_a_threading_layer_whose_openmp_is_there(tmp_path):
    r = doctor(tmp_path, MLXD_BLAS="mkl")
    layer = blas.mkl_threading_layer()
    assert f"threading {layer}" in r["blas"]["description"]
    # the [cpu] extra's mkl brings intel-openmp, whose runtime measured fastest
    assert layer == "INTEL"
    ctypes.CDLL(str(blas.pip_library("intel-openmp", "libiomp5.so")))  # loadable


@pytest.mark.skipif(sys.platform != "linux", reason="the BLAS preload is Linux-only")
def test_auto_takes_the_first_library_present_in_the_measured_order(tmp_path):
    if not DEBIAN_OPENBLAS and os.environ.get("CI"):
        pytest.fail(".ci/run should have installed libopenblas0-pthread")
    present = [name for name, paths in blas.candidates().items() if any(p.is_file() for p in paths)]
    r = doctor(tmp_path)
    if not present:
        assert r["blas"]["loaded"] is False
        return
    assert r["blas"]["loaded"] is True and r["blas"]["name"] == present[0]
    assert r["float32_matmul_gflops"] > 0
    assert list(blas.candidates()) == list(blas.ORDER)


def test_mkl_version_string_is_shortened(monkeypatch):
    text = (
        b"Intel(R) oneAPI Math Kernel Library Version 2026.2-Product Build 20260915 "
        b"for Intel(R) 64 architecture applications"
    )

    class FakeMkl:
        @staticmethod
        def MKL_Get_Version_String(buf, n):  # noqa: N802 - MKL's own name
            ctypes.memmove(buf, text, min(len(text), n - 1))

    monkeypatch.setenv("MKL_THREADING_LAYER", "GNU")
    assert blas.library_version(FakeMkl()) == "oneMKL 2026.2, threading GNU"
