"""A grammar as an mlx-lm logits processor: the engine core's side of structured output.

Each constrained sequence gets a :class:`GrammarProcessor` among its mlx-lm logits
processors. mlx-lm calls a row's processors with that row's token context and logits at
every decode step; the processor first advances its matcher with the token sampled at the
previous step (the context's last token), then masks every token the grammar does not allow
at this point (``-inf``). Rows without a grammar are untouched, so one batch mixes
constrained and free sequences. When the grammar is complete only EOS is allowed, so the
sequence ends with ``finish_reason == "stop"``; running out of ``max_tokens`` first ends it
with "length" (a truncated document). A matcher that fails on the way (a resource limit
of llguidance) ends its row with a GrammarError, which the client sees.

It lives apart from text/structured.py (grammar sources and validation) because front
ends validate grammars and must not import MLX (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from mlxd.core.errors import GrammarError
from mlxd.text.structured import first_line


class GrammarProcessor:
    """An mlx-lm logits processor that keeps one sequence inside its grammar.

    Called once per decode step of its row with (context tokens, logits of shape (1, V)).
    ``arm_after`` delays the constraint until those token ids have been generated (the end
    of a thinking part).
    """

    def __init__(
        self, matcher: Any, eos_token_ids: Sequence[int], arm_after: Sequence[int] | None = None
    ) -> None:
        self.matcher = matcher
        self.eos = list(eos_token_ids)
        self._arm = tuple(arm_after or ())
        self.armed = not self._arm
        self._tail: list[int] = []
        self._calls = 0
        self._pending = False  # our last mask applies to the context's last token

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        self._calls += 1
        if self._calls > 1:  # context[-1] was sampled after our previous call
            token = int(context[-1].item())
            if self.armed:
                if self._pending and not self.matcher.is_stopped():
                    self.matcher.consume_token(token)
            else:
                self._tail = (self._tail + [token])[-len(self._arm) :]
                if tuple(self._tail) == self._arm:
                    self.armed = True
        if not self.armed:
            return logits
        self._pending = True
        vocab = logits.shape[-1]
        bits = None if self.matcher.is_error() else self.matcher.compute_bitmask()
        if self.matcher.is_error():
            # what was generated is no valid document: the row ends with this error
            # (GuardedProcessors), never with an end-of-sequence that reads as "stop"
            raise GrammarError(
                "the grammar engine could not follow this schema or grammar while generating "
                f"({first_line(self.matcher.get_error())}); simplify it"
            )
        allowed = np.unpackbits(np.frombuffer(bits, dtype=np.uint8), bitorder="little")[
            :vocab
        ].astype(bool)
        if allowed.shape[0] < vocab:
            allowed = np.pad(allowed, (0, vocab - allowed.shape[0]))
        mask = mx.array(allowed)
        return mx.where(mask, logits, mx.array(-float("inf"), dtype=logits.dtype))
