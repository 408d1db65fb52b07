"""Quantization through mlx-lm's own conversion code (what ``mlx_lm.convert`` does).

``mlx_lm.convert`` insists on creating its output directory itself, while the store hands
out a fresh temp directory; so this runs convert's steps (lazy load, dtype cast,
``quantize_model``, ``save``) with the same functions, evaluating the quantized weights
tensor by tensor in between so that progress can be reported.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, cast

from mlxd.store.progress import ProgressFn, emitter

_DTYPES = ("float16", "bfloat16", "float32")


def quantize_dir(
    src: Path, out: Path, *, bits: int, group_size: int, progress: ProgressFn | None = None
) -> dict[str, Any]:
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map_with_path
    from mlx_lm.utils import load, quantize_model, save

    emit = emitter(progress)
    emit({"status": f"loading {src.name}"})
    # return_config=True makes load's result the three-item member of its union
    model, tokenizer, config = cast(
        "tuple[Any, Any, dict[str, Any]]", load(str(src), return_config=True, lazy=True)
    )

    dtype = config.get("torch_dtype") or (config.get("text_config") or {}).get("dtype")
    if dtype in _DTYPES:  # as mlx_lm.convert: keep the checkpoint's own float type
        target = getattr(mx, dtype)
        cast_predicate = getattr(model, "cast_predicate", lambda _k: True)

        def to_dtype(k: str, v: mx.array) -> mx.array:
            if cast_predicate(k) and mx.issubdtype(v.dtype, mx.floating):
                return v.astype(target)
            return v

        model.update(tree_map_with_path(to_dtype, model.parameters()))

    model, config = quantize_model(model, config, group_size, bits)

    # a list of (key, array) unless given a dict destination
    params = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    total = sum(v.nbytes for _, v in params)
    done, last = 0, 0.0
    status = f"quantizing to {bits}-bit"
    emit({"status": status, "total": total, "completed": 0})
    for _, v in params:
        mx.eval(v)
        done += v.nbytes
        now = time.monotonic()
        if now - last > 0.1:
            last = now
            emit({"status": status, "total": total, "completed": done})
    emit({"status": status, "total": total, "completed": total})

    emit({"status": "writing weights"})
    save(out, src, model, tokenizer, config)
    return {"quantization": {"bits": bits, "group_size": group_size}}
