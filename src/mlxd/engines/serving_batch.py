"""mlx-lm's continuous batch as the engine core runs it: prefill keeps MLX's buffer cache,
and the batch says how many newcomers make a clean prefill group.

mlx-lm's ``PromptProcessingBatch.prompt`` calls ``mx.clear_cache()`` after every prefill
chunk, which suits a script that prefills once and then decodes. In a server, newcomers
are prefilled while a decode batch runs, every few steps under load, and each clear hands
every cached buffer back to the device allocator (on CUDA a ``cudaFree``, which waits for
the device), so the decode steps that follow allocate their buffers anew. Here the buffer
cache is cleared only when it holds more than :data:`CACHE_KEEP_BYTES` (a long prompt's
chunk can leave big attention buffers behind) and when the batch runs dry (the engine
clears it then: engines/llm.py), so memory at rest is what mlx-lm leaves.

Everything else is mlx-lm's: the batch's right padding, chunking by
``prefill_step_size`` and the caches' ``prepare``/``finalize`` protocol. The group rule
(:meth:`ServingBatchGenerator.clean_group_room`) reads mlx-lm's queue and prompt batch,
which is why it lives here, beside the subclass, and not in the engine.
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

    def clean_group_room(self) -> int:
        """How many newcomers the batch takes now as one clean prefill group.

        mlx-lm moves queued sequences into its prompt batch up to ``prefill_batch_size``,
        and once a group is prefilled up to its last tokens, the next step moves it into
        the decode batch. Sequences that reach the prompt batch while such a group is still
        there are merged into it first: in one step mlx-lm then copies the batch's caches,
        splits the group off, starts its decoding and prefills the newcomers. On an H200
        such a mixed step cost about twice a clean prefill step, and a server's staggered
        arrivals made a third of its prefill steps mixed where an offline batch's waves
        make none (docs/benchmarks.md, "round 2, session 4"). So: none while sequences
        still wait in mlx-lm's own queue or a prefilled group is about to join; otherwise
        what the prompt batch has room for. A prompt still mid-prefill (longer than a
        prefill chunk) is no reason to wait: mlx-lm prefills newcomers beside its next
        chunk.
        """
        rows = self._currently_processing
        if self._unprocessed_sequences or (
                rows and all(len(segments) == 1 and len(segments[0]) == 1
                             for segments, *_ in rows)):
            return 0
        return max(self.prefill_batch_size - len(rows), 0)
