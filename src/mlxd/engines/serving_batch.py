"""mlx-lm's continuous batch as the engine core runs it: prefill keeps MLX's buffer cache.

mlx-lm's ``PromptProcessingBatch.prompt`` calls ``mx.clear_cache()`` after every prefill
chunk, which suits a script that prefills once and then decodes. In a server, newcomers
are prefilled while a decode batch runs, every few steps under load, and each clear hands
every cached buffer back to the device allocator (on CUDA a ``cudaFree``, which waits for
the device), so the decode steps that follow allocate their buffers anew. Here the buffer
cache is cleared only when it holds more than :data:`CACHE_KEEP_BYTES` (a long prompt's
chunk can leave big attention buffers behind) and when the batch runs dry (the engine
clears it then: engines/llm.py), so memory at rest is what mlx-lm leaves.

Everything else is mlx-lm's: the batch's right padding, chunking by
``prefill_step_size`` and the caches' ``prepare``/``finalize`` protocol.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, PromptProcessingBatch

CACHE_KEEP_BYTES = 1 << 30


def trim_buffer_cache(limit: int | None = None) -> None:
    """Clear MLX's buffer cache only when it holds more than ``limit`` bytes (default
    :data:`CACHE_KEEP_BYTES`)."""
    if mx.get_cache_memory() > (CACHE_KEEP_BYTES if limit is None else limit):
        mx.clear_cache()


class ServingPromptBatch(PromptProcessingBatch):
    """mlx-lm's prompt batch whose prefill trims the buffer cache instead of clearing it."""

    def prompt(self, tokens: list[list[int]]) -> None:
        if len(self.uids) != len(tokens):
            raise ValueError("The batch length doesn't match the number of inputs")
        if not tokens:
            return
        for held, new in zip(self.tokens, tokens, strict=True):
            held += new  # what the KV cache will hold, as mlx-lm keeps it
        lengths = [len(t) for t in tokens]
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        padded = any(padding)
        if padded:  # right padding, rolled away by the caches' finalize()
            inputs = mx.array([t + [0] * p for t, p in zip(tokens, padding, strict=True)])
            for c in self.prompt_cache:
                c.prepare(lengths=lengths, right_padding=padding)
        else:
            inputs = mx.array(tokens)
        step = self.prefill_step_size
        for start in range(0, longest, step):
            self.model(inputs[:, start:start + step], cache=self.prompt_cache)
            mx.eval([c.state for c in self.prompt_cache])
            trim_buffer_cache()
        if padded:
            for c in self.prompt_cache:
                c.finalize()
            mx.eval([c.state for c in self.prompt_cache])


class ServingBatchGenerator(BatchGenerator):
    """mlx-lm's BatchGenerator with :class:`ServingPromptBatch` as its prompt batch.

    Newcomers are merged into the one prompt batch made here (``extend``), and split off
    from it by copies of its class, so this one instance decides how every prefill runs.
    """

    def __init__(self, model: Any, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        self._prompt_batch = ServingPromptBatch.empty(
            self.model, self.sampler, prefill_step_size=self.prefill_step_size)
