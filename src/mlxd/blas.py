"""Load an optimised BLAS before MLX on Linux CPU.

MLX's Linux CPU wheel links a bundled *reference* BLAS: float32 matmuls run at ~5 GFLOP/s
where OpenBLAS, BLIS or MKL reach ~100 on the same core. MLX resolves ``cblas_*`` symbols
at load time, so a library with the standard CBLAS symbols loaded with ``RTLD_GLOBAL``
*before* ``import mlx.core`` takes over every float32 matmul. This module must not import
MLX itself, and is called first thing by the CLI.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_MULTIARCH = f"{platform.machine()}-linux-gnu"
_DEBIAN_DIRS = [Path("/usr/lib") / _MULTIARCH, Path("/usr/lib64"), Path("/usr/lib")]


@dataclass
class BlasInfo:
    name: str  # "openblas", "blis", "mkl", "custom", "reference"
    path: str | None
    loaded: bool
    note: str = ""

    def describe(self) -> str:
        if self.loaded:
            return f"{self.name} ({self.path}), loaded before MLX"
        return f"MLX's bundled reference BLAS{': ' + self.note if self.note else ''}"


_state: BlasInfo | None = None


def _debian(subdir: str) -> list[Path]:
    return [d / subdir / "libblas.so.3" for d in _DEBIAN_DIRS]


def _mkl_from_pip() -> list[Path]:
    """The ``mkl`` wheel ships libmkl_rt with the standard CBLAS symbols: pip alone suffices."""
    try:
        files = importlib.metadata.distribution("mkl").files or []
    except importlib.metadata.PackageNotFoundError:
        return []
    out = []
    for f in files:
        if Path(str(f)).name.startswith("libmkl_rt.so"):
            out.append(Path(str(f.locate())))
    return sorted(out)


def candidates() -> dict[str, list[Path]]:
    """Known libraries in preference order (measured on SmolLM2: docs/benchmarks.md)."""
    return {
        "openblas": _debian("openblas-pthread") + _debian("openblas-openmp")
        + [d / "libopenblas.so.0" for d in _DEBIAN_DIRS],
        "blis": _debian("blis-pthread") + _debian("blis-openmp"),
        "mkl": _mkl_from_pip(),
    }


def preload(choice: str = "auto") -> BlasInfo:
    """Load the chosen BLAS (``auto``, ``off``, ``openblas``, ``blis``, ``mkl`` or a path)."""
    global _state
    if _state is not None:
        return _state
    if sys.platform != "linux":
        _state = BlasInfo("native", None, False, "not Linux: MLX uses the platform's BLAS")
        return _state
    if choice == "off":
        _state = BlasInfo("reference", None, False, "disabled by setting")
        return _state
    if "mlx.core" in sys.modules:
        _state = BlasInfo("reference", None, False, "MLX was imported before mlxd could load "
                          "a BLAS (use LD_PRELOAD or import mlxd.blas first)")
        return _state
    table = candidates()
    if choice == "auto":
        order = [(name, p) for name, paths in table.items() for p in paths]
    elif choice in table:
        order = [(choice, p) for p in table[choice]]
    else:
        order = [("custom", Path(choice).expanduser())]
    for name, path in order:
        if not path.is_file():
            continue
        if name == "mkl":
            # Intel's OpenMP runtime is a separate wheel; GNU OpenMP ships with the system.
            os.environ.setdefault("MKL_THREADING_LAYER", "GNU")
        try:
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            log.debug("could not load %s: %s", path, exc)
            continue
        _state = BlasInfo(name, str(path), True)
        return _state
    hint = ("install one: apt-get install libopenblas0-pthread (or libblis4-pthread), "
            "or pip install mkl")
    _state = BlasInfo("reference", None, False,
                      f"no optimised BLAS found for '{choice}'; float32 matmuls are ~20x "
                      f"slower; {hint}")
    return _state


def current() -> BlasInfo | None:
    return _state
