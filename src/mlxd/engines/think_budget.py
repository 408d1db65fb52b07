"""A reasoning budget as an mlx-lm logits processor (``thinking_token_budget``).

When a row's reasoning part has used its budget, the processor allows only the think-end
ids, one per step, so the part closes and the answer follows; the tokens counted are the
generated ones inside the part (text/thinking.py). It runs after every other processor of
its row, so nothing lifts its mask; a grammar that waits for the end of the thinking part
(``arm_after``) sees the forced ids like any others.
"""

from __future__ import annotations

from typing import cast

import mlx.core as mx

from mlxd.core.types import ThinkSpec
from mlxd.text.thinking import ThinkTracker


class ThinkBudgetProcessor:
    def __init__(self, spec: ThinkSpec) -> None:
        assert spec.budget is not None
        self.budget = spec.budget
        self.tracker = ThinkTracker(spec)
        self._calls = 0
        self._forced = 0

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        self._calls += 1
        if self._calls > 1:  # context[-1] was sampled after the previous call
            self.tracker.observe(cast(int, context[-1].item()))
            if self._forced and not self.tracker.thinking:
                self._forced = 0
        token = self.tracker.end_ids_to_force(self.budget, self._forced)
        if token is None:
            return logits
        self._forced += 1
        only = mx.arange(logits.shape[-1]) == token
        return mx.where(only, logits, mx.array(-float("inf"), dtype=logits.dtype))
