"""Where a generation stands relative to a thinking model's reasoning part.

One state machine, fed the generated token ids one by one, used on both sides of the
process boundary: the engine core ends a reasoning part that reaches its budget
(engines/think_budget.py), and the front end counts reasoning tokens for ``usage``
(``completion_tokens_details.reasoning_tokens``). The part opens with the tokenizer's
think-start ids or with the prompt itself (a template that ends in ``<think>``), and closes
with its think-end ids; the closing ids are not counted as reasoning, and a model thinks
once per reply (a second ``<think>`` after the first part closed is answer text).
"""

from __future__ import annotations

from mlxd.core.types import ThinkSpec


class ThinkTracker:
    def __init__(self, spec: ThinkSpec) -> None:
        self.start = tuple(spec.start)
        self.end = tuple(spec.end)
        self.thinking = spec.open  # the prompt opened the part
        self.closed = False
        self.reasoning_tokens = 0
        self._tail: list[int] = []
        self._keep = max(len(self.start), len(self.end), 1)

    def observe(self, token: int) -> None:
        """One generated token."""
        self._tail = (self._tail + [token])[-self._keep :]
        if self.thinking:
            if self.end and tuple(self._tail[-len(self.end) :]) == self.end:
                self.thinking, self.closed = False, True
                # the end marker's earlier ids were counted as they came
                self.reasoning_tokens -= len(self.end) - 1
            else:
                self.reasoning_tokens += 1
        elif not self.closed and self.start and tuple(self._tail[-len(self.start) :]) == self.start:
            self.thinking = True
            self._tail = []

    def end_ids_to_force(self, budget: int, forced: int) -> int | None:
        """The id to force next when the part has used ``budget`` tokens (``forced`` of the
        end marker's ids already forced), or None when nothing needs forcing."""
        if not self.thinking or not self.end:
            return None
        if forced or self.reasoning_tokens >= budget:
            return self.end[forced] if forced < len(self.end) else None
        return None
