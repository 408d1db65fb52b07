"""What every engine offers the device worker, and the decode engines' shared base.

Text (engines/llm.py) and vision (engines/vlm.py) decode the same way: sequences wait,
join a batch, produce one token per step, leave on EOS, length or cancellation, and fail
together only on a true device fault. :class:`DecodeEngine` holds that bookkeeping and
what a step emits; the families are small adapters around their library's batch.

The core emits token ids, never text: detokenizing, stop strings and output parsing run in
the front ends (frontend/generation.py), off the device thread.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, cast, runtime_checkable

import mlx.core as mx
import numpy as np

from mlxd.core.types import SamplingParams, ThinkSpec


@runtime_checkable
class Engine(Protocol):
    """What the device worker (runtime/worker.py) needs of any engine."""

    name: str
    kind: str

    def add(self, seq: Any) -> None: ...
    def cancel(self, seq: Any) -> None: ...
    def has_work(self) -> bool: ...
    def next_deadline(self) -> float | None: ...
    def step(self) -> list[tuple[Any, Any]]: ...
    def fail_all(self, exc: Exception) -> list[tuple[Any, Any]]: ...
    def close(self) -> None: ...
    def stats(self) -> dict[str, Any]: ...
    def memory_bytes(self) -> dict[str, int]: ...
    def shrink(self) -> int: ...


@dataclass(slots=True)
class StepOutput:
    """One step's result for one sequence: a token (None when the sequence ended without
    one), why it ended, its log-probability data, or the error that ended it."""

    token: int | None
    finish_reason: str | None = None
    logprob: tuple[float, list[int], list[float]] | None = None  # (lp, top ids, top lps)
    error: Exception | None = None
    queued_s: float | None = None  # first token only: arrival in the engine -> in the batch


@dataclass(eq=False)
class Sequence:
    """One request's state inside an engine. ``handle`` belongs to whoever submitted it."""

    prompt_tokens: list[int]
    params: SamplingParams
    grammar: Any = None  # an llguidance matcher (text models)
    arm_after: tuple[int, ...] | None = None
    think: ThinkSpec | None = None  # a thinking model's markers and the request's budget
    adapter: tuple[str, str] | None = None  # a LoRA adapter's name and directory
    handle: Any = None
    uid: int = -1
    generated: int = 0
    finished: bool = False
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    cache_salt: str | None = None  # the prefix-cache partition it reads and fills
    priority: int = 0  # lower runs first (engines/scheduler.py)
    tenant: str = ""  # the API key's owner id: who shares the engine fairly with whom
    weight: float = 1.0  # the tenant's share among tenants waiting at one priority
    arrival: int = 0  # admission order (engines/scheduler.py); kept across a preemption
    output: list[int] = field(default_factory=list)  # the tokens emitted so far
    folded: int = 0  # of ``output``, how many a preemption moved into ``prompt_tokens``
    cached_first: int | None = None  # a resumed row: its first admission's cached_tokens
    t_added: float = 0.0
    t_scheduled: float = 0.0  # when it joined the batch (monotonic)
    t_first: float = 0.0  # when its first token came out (monotonic): prefill's end
    error: Exception | None = None  # its own processors failed: it ends alone, with this
    extra: Any = field(default=None, repr=False)  # the family adapter's own state


class DecodeEngine(abc.ABC):
    """Shared bookkeeping of a decode engine; subclasses run their library's batch."""

    name: str
    kind: str
    vocab_size: int

    def __init__(self) -> None:
        self.max_batch_seen = 0
        self.steps = 0

    # -- the worker's view ---------------------------------------------------------------
    def next_deadline(self) -> float | None:
        return None

    # -- what /health and the memory budget read -------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The family's own figures for /health (prefix cache, image-feature cache...)."""
        return {}

    def memory_bytes(self) -> dict[str, int]:
        """Memory held beyond the weights, by kind (KV cache, caches)."""
        return {}

    def shrink(self) -> int:
        """Drop reusable caches (device thread); the bytes freed."""
        return 0

    def kv_options(self) -> dict[str, Any]:
        """The KV-cache options this engine runs with (for /health)."""
        options = getattr(self, "options", None)  # engines/options.py's, by kind
        return {
            k: getattr(options, k)
            for k in ("kv_bits", "kv_quant_scheme", "kv_group_size", "max_kv_size")
            if hasattr(options, k)
        }

    def new_sequence(
        self,
        prompt_tokens: list[int],
        params: SamplingParams,
        *,
        grammar: Any = None,
        arm_after: tuple[int, ...] | None = None,
        think: ThinkSpec | None = None,
    ) -> Sequence:
        return Sequence(
            prompt_tokens=prompt_tokens,
            params=params,
            grammar=grammar,
            arm_after=arm_after,
            think=think,
        )

    @abc.abstractmethod
    def _sequences(self) -> list[Sequence]:
        """Every sequence the engine holds (waiting or running)."""

    @abc.abstractmethod
    def _reset(self) -> None:
        """Forget every sequence and start a clean batch (after a device fault)."""

    def fail_all(self, exc: Exception) -> list[tuple[Sequence, StepOutput]]:
        """After an exception inside a step: end every sequence, waiting ones included (a
        sequence left waiting would be admitted later and decode for nobody)."""
        out = []
        for seq in self._sequences():
            seq.finished = True
            out.append((seq, StepOutput(None, "error", error=exc)))
        try:
            self._reset()
        finally:
            mx.clear_cache()
        return out

    # -- what a step emits ---------------------------------------------------------------
    def _emit(
        self, seq: Sequence, token: int | None, finish: str | None, logprobs: mx.array | None
    ) -> StepOutput:
        if token is not None:
            seq.generated += 1
            seq.output.append(token)
        out = StepOutput(token, finish)
        if seq.generated == 1:
            seq.t_first = time.monotonic()
        if seq.generated == 1 and seq.t_scheduled and seq.t_added:
            out.queued_s = max(seq.t_scheduled - seq.t_added, 0.0)
        if seq.params.logprobs and token is not None and logprobs is not None:
            out.logprob = _logprob(token, logprobs, seq.params.top_logprobs)
        return out


class GuardedProcessors:
    """One row's logits processors, isolated: an exception fails that row alone.

    mlx-lm runs every row's processors inside one batched step; one raising would fail the
    whole batch. Here the row records the error, is steered to an end-of-sequence token so
    the batch lets it go, and the engine reports the error for that sequence only.
    """

    __slots__ = ("seq", "processors", "eos")

    def __init__(self, seq: Sequence, processors: list, eos_token_ids: list[int]) -> None:
        self.seq = seq
        self.processors = processors
        self.eos = eos_token_ids

    def __call__(self, context: mx.array, logits: mx.array) -> mx.array:
        if self.seq.error is None:
            try:
                for proc in self.processors:
                    logits = proc(context, logits)
                return logits
            except Exception as exc:  # noqa: BLE001 - this row fails, the batch lives
                self.seq.error = exc
        vocab = logits.shape[-1]
        allowed = [t for t in self.eos if t < vocab]
        if not allowed:
            return logits
        mask = mx.zeros((vocab,), dtype=mx.bool_).at[mx.array(allowed)].add(True)
        return mx.where(mask, logits, mx.array(-float("inf"), dtype=logits.dtype))


def _logprob(token: int, logprobs: mx.array, top: int) -> tuple[float, list[int], list[float]]:
    """(the token's log-probability, the top ids, their log-probabilities), as numbers.

    Read from the host's copy of the step's (already evaluated) row: an MLX op here would
    queue behind the next decode step, already in flight (engines/serving_batch.py), and
    wait for it."""
    row = host_row(logprobs)
    if row is None:
        return _device_logprob(token, logprobs, top)
    if top <= 0:
        return float(row[token]), [], []
    top = min(top, row.size)
    idx = np.argpartition(-row, top - 1)[:top]
    idx = idx[np.argsort(-row[idx], kind="stable")]
    return float(row[token]), idx.tolist(), row[idx].tolist()


def host_row(a: mx.array) -> np.ndarray | None:
    """An evaluated 1-D ``a`` as float32 numpy through its buffer, with no MLX op; None
    when it is not contiguous or its memory does not export a buffer (numpy has no
    bfloat16: its bits are widened here)."""
    try:
        view = memoryview(cast(Any, a))  # MLX arrays export the buffer protocol
    except (BufferError, TypeError, ValueError, RuntimeError):
        return None
    if not view.c_contiguous:
        return None
    if a.dtype == mx.bfloat16:
        bits = np.frombuffer(view.cast("B"), dtype=np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32)
    return np.asarray(view, dtype=np.float32).reshape(-1)


def _device_logprob(
    token: int, logprobs: mx.array, top: int
) -> tuple[float, list[int], list[float]]:
    if top <= 0:
        return float(logprobs[token].item()), [], []
    idx = mx.argpartition(-logprobs, kth=top - 1)[:top]
    vals = logprobs[idx]
    order = mx.argsort(-vals)
    lp, ids, top_lps = logprobs[token], idx[order], vals[order]
    mx.eval(lp, ids, top_lps)
    return float(lp.item()), ids.tolist(), top_lps.tolist()
