"""Which MLX backend this process runs on, and what that implies for defaults."""

from __future__ import annotations

from mlxd.dtype_policy import backend_name, wants_float32

__all__ = ["apply_dtype", "backend_name", "wants_float32"]


def apply_dtype(model, config: dict, dtype: str) -> str:
    """Cast float weights per the ``models.dtype`` policy; quantized models stay as they are.

    'auto' means float32 on the CPU backend (half and quantized matmuls are 10-50x slower
    there) and the checkpoint's own dtype elsewhere. Returns the dtype now in use.
    """
    import mlx.core as mx

    if "quantization" in config:
        return "quantized"
    target = None
    if dtype == "float32" or (dtype == "auto" and wants_float32()):
        target = mx.float32
    elif dtype in ("float16", "bfloat16"):
        target = getattr(mx, dtype)
    if target is None:
        return "native"
    floats = (mx.float16, mx.bfloat16, mx.float32)
    model.apply(lambda x: x.astype(target) if x.dtype in floats else x)
    return str(target).split(".")[-1]
