"""How much memory models may use, and how much a model will take before it is loaded.

The estimate reads safetensors headers (dtype and shape of every tensor) rather than file
sizes, because a half-precision checkpoint cast to float32 on the CPU takes twice its size.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from mlxd.store.inspect import safetensors_header

_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "U32": 4,
    "I16": 2,
    "U16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def default_budget() -> int:
    """75% of the GPU's recommended working set, or 60% of RAM on the CPU."""
    try:
        import mlx.core as mx

        info = mx.device_info()
        for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
            v = info.get(key)
            if isinstance(v, int) and v > 0 and mx.default_device() != mx.cpu:
                return int(v * 0.75)
    except Exception:  # noqa: BLE001 - no device info: fall back to RAM
        pass
    return int(physical_memory() * 0.6)


def estimate_model_bytes(model_dir: Path, *, upcast_half: bool) -> int:
    """Bytes the weights take once loaded; ``upcast_half``: F16/BF16 become float32."""
    model_dir = Path(model_dir)
    quantized = False
    cfg = model_dir / "config.json"
    if cfg.is_file():
        try:
            quantized = "quantization" in json.loads(cfg.read_text())
        except (OSError, ValueError):
            pass
    total = 0
    for f in model_dir.glob("*.safetensors"):
        try:
            header = safetensors_header(f)
        except (OSError, ValueError, struct.error):
            total += f.stat().st_size
            continue
        for name, t in header.items():
            if name == "__metadata__":
                continue
            start, end = t["data_offsets"]
            nbytes = end - start
            if upcast_half and not quantized and t["dtype"] in ("F16", "BF16"):
                nbytes *= 2
            total += nbytes
    return total
