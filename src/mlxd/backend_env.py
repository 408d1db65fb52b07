"""MLX switches that the supervisor puts in the engine-core processes' environment.

MLX reads these variables once per process (a static on first use), so they must be there
when the process starts: ``enginecore/supervisor.py`` adds :func:`core_env` to the
environment of every engine core it starts (tensor-parallel ranks included). No MLX import
here: the serving process never loads MLX.
"""

from __future__ import annotations

from mlxd.config import BackendSettings

CUDNN_SDPA_ENV = "MLX_CUDA_USE_CUDNN_SDPA"


def core_env(backend: BackendSettings) -> dict[str, str]:
    """``backend.cudnn_attention``: cuDNN's fused attention on or off (only MLX's CUDA
    backend reads the variable)."""
    return {CUDNN_SDPA_ENV: "1" if backend.cudnn_attention else "0"}
