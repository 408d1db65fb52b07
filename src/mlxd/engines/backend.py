"""Which MLX backend this process runs on, and what that implies for defaults."""

from __future__ import annotations

import platform

import mlx.core as mx


def backend_name() -> str:
    """'metal', 'cuda' or 'cpu': the device MLX computes on by default."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    if platform.system() == "Darwin":
        return "metal"
    return "cuda"


def wants_float32() -> bool:
    """On the CPU backend float32 matmuls go to BLAS; half and quantized ones crawl."""
    return backend_name() == "cpu"
