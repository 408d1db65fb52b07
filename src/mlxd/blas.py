"""Load an optimised BLAS before MLX on Linux CPU.

MLX's Linux CPU wheel links a bundled *reference* BLAS: float32 matmuls run at ~6 GFLOP/s
where OpenBLAS or MKL reach 100-200 on the same two cores. MLX resolves ``cblas_*`` symbols
at load time, so a library with the standard CBLAS symbols loaded with ``RTLD_GLOBAL``
*before* ``import mlx.core`` takes over every float32 matmul (libmlx calls
``cblas_sgemm``, ``cblas_dgemm`` and ``cblas_cgemm``). This module must not import MLX
itself, and is called first thing by the CLI and the server.

Where a library comes from: Debian's ``libopenblas0-pthread`` or ``libblis4-pthread``, or
the PyPI ``mkl`` wheel, which the ``cpu`` extra installs on Linux x86_64 so that pip alone
gives a fast BLAS. The ``scipy-openblas32/64`` wheels cannot stand in: their symbols are
prefixed (``scipy_cblas_sgemm``), and the ``blis`` wheel exports only BLIS's own API.
"""

from __future__ import annotations

import ctypes
import ctypes.util
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

# ``auto`` tries these in order: measured on SmolLM2-135M float32 and all-MiniLM-L6-v2
# (docs/benchmarks.md, "MLX on Linux CPU"): OpenBLAS leads on batched decode and
# embeddings, what a server runs; MKL, the one pip can bring, is close behind on prefill
# and ahead on single-sequence decode; BLIS batches worst.
ORDER = ("openblas", "mkl", "blis")


@dataclass
class BlasInfo:
    name: str  # "openblas", "blis", "mkl", "custom", "reference", "native"
    path: str | None
    loaded: bool
    note: str = ""
    version: str = ""  # what the library says of itself, when it says

    def describe(self) -> str:
        if self.loaded:
            what = f"{self.version}, " if self.version else ""
            return f"{self.name} ({what}{self.path}), loaded before MLX"
        return f"MLX's bundled reference BLAS{': ' + self.note if self.note else ''}"


_state: BlasInfo | None = None


def _debian(subdir: str) -> list[Path]:
    return [d / subdir / "libblas.so.3" for d in _DEBIAN_DIRS]


def pip_library(dist: str, prefix: str) -> Path | None:
    """A shared library of an installed wheel (e.g. intel-openmp's libiomp5), or None."""
    try:
        files = importlib.metadata.distribution(dist).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if Path(str(f)).name.startswith(prefix):
            return Path(str(f.locate())).resolve()
    return None


def _mkl_from_pip() -> list[Path]:
    """The ``mkl`` wheel ships libmkl_rt with the standard CBLAS symbols: pip alone suffices."""
    path = pip_library("mkl", "libmkl_rt.so")
    return [path] if path else []


def candidates() -> dict[str, list[Path]]:
    """Known libraries by name, in ``ORDER`` (the order ``auto`` tries them)."""
    table = {
        "openblas": _debian("openblas-pthread")
        + _debian("openblas-openmp")
        + [d / "libopenblas.so.0" for d in _DEBIAN_DIRS],
        "mkl": _mkl_from_pip(),
        "blis": _debian("blis-pthread") + _debian("blis-openmp"),
    }
    return {name: table[name] for name in ORDER}


def mkl_threading_layer() -> str:
    """Intel's OpenMP where its wheel (``intel-openmp``, a dependency of ``mkl``) is
    installed: measured ~2x the embeddings rate of GNU OpenMP and a little more batched
    decode (docs/benchmarks.md). Else GNU OpenMP where the system has libgomp, else one
    thread (no OpenMP runtime at all)."""
    if pip_library("intel-openmp", "libiomp5.so"):
        return "INTEL"
    return "GNU" if ctypes.util.find_library("gomp") else "SEQUENTIAL"


def library_version(lib: ctypes.CDLL) -> str:
    """The library's own version string (OpenBLAS, MKL, BLIS), or "" if it has none."""
    for fn in ("openblas_get_config", "bli_info_get_version_str"):
        f = getattr(lib, fn, None)
        if f is not None:
            f.restype = ctypes.c_char_p
            text = (f() or b"").decode(errors="replace")
            return f"BLIS {text}" if fn.startswith("bli") else text
    f = getattr(lib, "MKL_Get_Version_String", None)
    if f is not None:
        buf = ctypes.create_string_buffer(256)
        f(buf, len(buf))
        text = buf.value.decode(errors="replace")
        # "Intel(R) oneAPI Math Kernel Library Version 2026.2-Product Build ..." -> short
        if "Version " in text:
            text = "oneMKL " + text.split("Version ", 1)[1].split("-", 1)[0].split(" ")[0]
        return text + f", threading {os.environ.get('MKL_THREADING_LAYER', 'default')}"
    return ""


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
        _state = BlasInfo(
            "reference",
            None,
            False,
            "MLX was imported before mlxd could load "
            "a BLAS (use LD_PRELOAD or import mlxd.blas first)",
        )
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
        if name == "mkl" or path.name.startswith("libmkl_rt"):
            os.environ.setdefault("MKL_THREADING_LAYER", mkl_threading_layer())
        try:
            lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            log.debug("could not load %s: %s", path, exc)
            continue
        _state = BlasInfo(name, str(path), True, version=library_version(lib))
        return _state
    hint = (
        "install one: pip install mkl (Linux x86_64; the 'cpu' extra does), or "
        "apt-get install libopenblas0-pthread (or libblis4-pthread)"
    )
    _state = BlasInfo(
        "reference",
        None,
        False,
        f"no optimised BLAS found for '{choice}'; float32 matmuls are ~20x slower; {hint}",
    )
    return _state


def current() -> BlasInfo | None:
    return _state
