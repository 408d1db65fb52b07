"""A bounded KV cache for text models in mlx-lm's batch (``max_kv_size``).

mlx-lm 0.32's ``BatchGenerator(max_kv_size=...)`` builds each new sequence's cache with
``make_prompt_cache(model, max_kv_size)``, which honours the bound only for models without
a ``make_cache`` method: 53 of its 137 architectures have one (Llama among them, for its
optional sliding-window layers), and for those the bound was silently dropped. Here every
layer whose cache would be a plain, unbounded ``KVCache`` becomes a ``RotatingKVCache`` of
``max_kv_size`` tokens; the model's other layers (its own sliding windows, recurrent state)
keep what the model asked for. In the batch, mlx-lm merges rotating caches into a
``BatchRotatingKVCache``, so bounded sequences still decode together.

Quantized KV caches are another matter: mlx-lm has no batched quantized cache and
``QuantizedKVCache`` cannot be merged into a batch, so text models refuse ``kv_bits``
(engines/registry.py).
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from mlxd.engines.serving_batch import ServingBatchGenerator


def bounded_prompt_cache(model: Any, max_kv_size: int) -> list[Any]:
    """A fresh per-sequence cache whose unbounded KV layers hold ``max_kv_size`` tokens.

    ``keep=0``: mlx-lm's batched rotating cache keeps no attention-sink tokens, so a
    per-sequence ``keep`` would be dropped as soon as the sequence joins the batch.
    """
    return [
        RotatingKVCache(max_size=max_kv_size, keep=0) if type(c) is KVCache else c
        for c in make_prompt_cache(model)
    ]


def can_bound(model: Any) -> bool:
    """Whether any layer of ``model`` has a plain KV cache that ``max_kv_size`` bounds."""
    return any(type(c) is KVCache for c in make_prompt_cache(model))


class BoundedBatchGenerator(ServingBatchGenerator):
    """The serving batch (engines/serving_batch.py) whose new sequences get
    :func:`bounded_prompt_cache`.

    Sequences inserted with a cache (a prefix-cache hit) keep theirs: it was extracted from
    this same bounded batch.
    """

    def __init__(self, model: Any, *, max_kv_size: int, **kwargs: Any) -> None:
        super().__init__(model, max_kv_size=max_kv_size, **kwargs)
        self._bound = max_kv_size

    def insert_segments(
        self,
        segments: list,
        max_tokens: Any = None,
        caches: list | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        caches = [
            c if c is not None else bounded_prompt_cache(self.model, self._bound)
            for c in (caches or [None] * len(segments))
        ]
        return super().insert_segments(segments, max_tokens, caches, *args, **kwargs)
