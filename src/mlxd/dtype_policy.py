"""Which float type the weights should be in on this MLX backend: one decision, one place.

The model store (GGUF import) and the engines (casting loaded weights) both follow the
``models.dtype`` setting, whose "auto" depends on the backend. Both import it from here, a
leaf module with no mlxd imports, so the store never reaches up into the engines for it.
"""

from __future__ import annotations

import platform

__all__ = ["backend_name", "gguf_import_dtype", "wants_float32"]


def backend_name() -> str:
    """'metal', 'cuda' or 'cpu': the device MLX computes on by default."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        return "cpu"
    if platform.system() == "Darwin":
        return "metal"
    return "cuda"


def wants_float32() -> bool:
    """On the CPU backend float32 matmuls go to BLAS; half and quantized ones crawl."""
    return backend_name() == "cpu"


def gguf_import_dtype(setting: str) -> str:
    """What a GGUF import should write for the ``models.dtype`` setting.

    "auto" means float32 on the CPU backend (quantized matmuls are 10-50x slower there)
    and the file's own quantization ("native", as MLX affine) elsewhere; any other value
    is taken as it is.
    """
    if setting != "auto":
        return setting
    return "float32" if wants_float32() else "native"
