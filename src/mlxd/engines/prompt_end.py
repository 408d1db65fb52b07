"""A newcomer's first token from its prefill pass: logits at each row's last prompt position.

mlx-lm prefills a prompt up to its last token, and feeds that token alone in a forward
pass of its own (``GenerationBatch.__init__``), a step later, whose logits give the
first token; the row then joins the decode batch, which emits that token one step after.
That pass reads every weight of the model for a few rows: on a CPU it costs about what a
decode step of the whole batch does (join steps of 188-203 ms against 130-135 ms decode
steps for SmolLM2-135M at 16 rows), and it puts a whole step before the first token.

Here the last token goes into the prefill's last chunk, and only the rows' last positions
go through the model's final norm and LM head (over every position of a chunk the head
would cost its vocabulary-sized matmul once per prompt token). The model is not
rewritten: during that one call its final norm is wrapped so that it keeps each row's
last position first. Every position of a decoder is independent after its final norm
(the head, logit scaling, soft-capping), so the logits are the model's own. Which models
this holds for is checked, not assumed: :func:`supports_prompt_end` runs a short prompt
both ways at load, and a model whose final norm is named otherwise, or whose logits
differ, keeps mlx-lm's extra pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

log = logging.getLogger(__name__)


class _Picked(nn.Module):
    """The final norm over the positions ``pick`` keeps of its input."""

    def __init__(self, norm: nn.Module, pick: Callable[[mx.array], mx.array]) -> None:
        super().__init__()
        self.norm = norm
        self.pick = pick

    def __call__(self, h: mx.array) -> mx.array:
        return self.norm(self.pick(h))


def decoder(model: Any) -> Any:
    """The module whose ``norm`` is the model's final norm (mlx-lm's layout), or None."""
    for inner in (
        getattr(model, "model", None),
        getattr(getattr(model, "language_model", None), "model", None),
    ):
        if isinstance(inner, nn.Module) and isinstance(inner.get("norm"), nn.Module):
            return inner
    return None


@contextmanager
def final_norm_over(model: Any, pick: Callable[[mx.array], mx.array]) -> Iterator[None]:
    """During the block, the model's final norm (so its head too) sees only what ``pick``
    keeps of the last hidden states ``[rows, positions, dim]``."""
    inner = decoder(model)
    if inner is None:
        raise ValueError("the model has no final norm where mlx-lm's layout puts it")
    norm = inner.norm
    inner.norm = _Picked(norm, pick)
    try:
        yield
    finally:
        inner.norm = norm


def last_logits(model: Any, inputs: mx.array, cache: list[Any], last: list[int]) -> mx.array:
    """``model(inputs, cache)`` (filling the cache as a prefill does), returning only the
    logits at position ``last[i]`` of row ``i``: ``[rows, vocab]``."""
    index = mx.array(last)
    with final_norm_over(model, lambda h: h[mx.arange(h.shape[0]), index][:, None, :]):
        logits = model(inputs, cache=cache)
    return logits[:, -1, :]


def supports_prompt_end(model: Any) -> bool:
    """Whether :func:`last_logits` gives this model's own logits: a short prompt run both
    ways, compared. False (mlx-lm's extra pass stays) for any doubt."""
    if decoder(model) is None:
        return False
    tokens = mx.array([[1, 2, 3, 4]])
    try:
        full = model(tokens, cache=make_prompt_cache(model))[:, -1, :]
        ours = last_logits(model, tokens, make_prompt_cache(model), [3])
        a, b = full.astype(mx.float32), ours.astype(mx.float32)
        same = a.shape == b.shape and bool(mx.allclose(a, b, rtol=1e-2, atol=1e-2).item())
    except Exception:  # noqa: BLE001 - a layout this does not know: mlx-lm's way
        log.debug("first token from the prefill pass: not for this model", exc_info=True)
        return False
    if not same:
        log.info("first token from the prefill pass: off for this model (logits differ)")
    return same
