"""``mlxd doctor``: what this machine gives MLX, and what mlxd will use."""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from mlxd.config import ConfigError, load_settings


def doctor(
    config: Annotated[Optional[Path], typer.Option("--config", "-c")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Report the MLX backend, the BLAS in use (with a matmul measurement) and versions."""
    try:
        settings = load_settings(config)
    except ConfigError as exc:
        typer.echo(f"mlxd: configuration error:\n{exc}", err=True)
        raise typer.Exit(2) from None
    from mlxd import __version__, blas

    info = blas.preload(settings.backend.blas)
    import importlib.metadata as md

    import mlx.core as mx

    from mlxd.engines.backend import backend_name

    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    n = 1024
    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(a @ b)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        mx.eval(a @ b)
        times.append(time.perf_counter() - t0)
    gflops = 2 * n**3 / sorted(times)[1] / 1e9
    report = {
        "mlxd": __version__,
        "python": sys.version.split()[0],
        "platform": f"{platform.system()} {platform.machine()}",
        "mlx": version("mlx"),
        "mlx_lm": version("mlx-lm"),
        "backend": backend_name(),
        "device": str(mx.default_device()),
        "device_info": {k: v for k, v in mx.device_info().items() if isinstance(v, (int, str))},
        "blas": {
            "name": info.name,
            "path": info.path,
            "loaded": info.loaded,
            "version": info.version or None,
            "description": info.describe(),
        },
        "float32_matmul_gflops": round(gflops, 1),
        "home": str(settings.home),
        "models_dir": str(settings.models_dir),
    }
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    width = max(len(k) for k in report)
    for k, v in report.items():
        if isinstance(v, dict):
            v = v.get("description") or ", ".join(f"{kk}={vv}" for kk, vv in v.items())
        typer.echo(f"{k.ljust(width)}  {v}")
    if report["backend"] == "cpu" and not info.loaded:
        typer.echo(
            "\nhint: float32 matmuls use MLX's reference BLAS; "
            "pip install mkl (Linux x86_64: the 'cpu' extra brings it) or "
            "apt-get install libopenblas0-pthread for ~20x."
        )
