"""What every encoder engine shares: the worker protocol over a :class:`BatchQueue`,
tokenizer loading, timing and metrics.

The worker calls ``add``/``cancel``/``has_work``/``next_deadline``/``step``/``fail_all`` on
its own thread; subclasses implement ``_forward(items) -> list`` (one result per item,
plain Python/numpy values) and the thread-safe ``encode_*`` helpers the runtime calls off
the worker to turn text into token ids.
"""

from __future__ import annotations

import abc
import json
import logging
import time
from pathlib import Path
from typing import Any

from mlxd.core.errors import ContextLengthExceeded, InvalidRequest
from mlxd.engines.batching import (
    BatchPolicy,
    BatchQueue,
    EncodeItem,
    EncodeJob,
    error_events,
    events_for,
    jobs_of,
)

log = logging.getLogger(__name__)


def batch_policy(settings: Any, **over: Any) -> BatchPolicy:
    """The ``batch:`` section of the settings as a BatchPolicy."""
    b = getattr(settings, "batch", None)
    if b is None:
        return BatchPolicy(**over)
    p = BatchPolicy(
        max_batch_size=b.max_batch_size,
        max_batch_tokens=b.max_batch_tokens,
        max_wait_s=b.max_wait_ms / 1000.0,
    )
    for k, v in over.items():
        setattr(p, k, v)
    return p


def llm_batch_policy(settings: Any) -> BatchPolicy:
    """For LLM rerankers: a pass holds no more tokens than one prefill step of the chat
    engine (``prefill_batch_size`` x ``prefill_step_size``), so scoring interleaves with
    decode at the same grain as prompt processing does."""
    p = batch_policy(settings, pass_overhead_tokens=16)
    e = getattr(settings, "engine", None)
    if e is not None:
        p.max_batch_tokens = min(p.max_batch_tokens, e.prefill_batch_size * e.prefill_step_size)
    return p


class BatchingEncoder(abc.ABC):
    """Base of the embedding and reranking engines (see module docstring)."""

    kind = "embedding"
    name: str
    nbytes: int = 0
    context_length: int = 512

    def __init__(self, name: str, policy: BatchPolicy) -> None:
        self.name = name
        self.policy = policy
        self._q = BatchQueue(policy)
        self.max_batch_seen = 0
        self.passes = 0
        self.inputs_done = 0

    # -- worker protocol -----------------------------------------------------------------
    def add(self, job: EncodeJob) -> None:
        self._q.add(job)

    def cancel(self, job: EncodeJob) -> None:
        self._q.cancel(job)

    def stats(self) -> dict[str, Any]:
        return {}

    def memory_bytes(self) -> dict[str, int]:
        return {}

    def shrink(self) -> int:
        return 0

    def has_work(self) -> bool:
        return self._q.has_work()

    def next_deadline(self) -> float | None:
        return self._q.next_deadline()

    @property
    def num_running(self) -> int:
        return self._q.num_running

    @property
    def num_waiting(self) -> int:
        return self._q.num_waiting

    def step(self) -> list[tuple[EncodeJob, Any]]:
        items = self._q.next_pass()
        if not items:
            return []
        t0 = time.perf_counter()
        mono = time.monotonic()
        try:
            values = self._forward(items)
        except Exception as exc:  # noqa: BLE001 - fail this pass's requests, keep the rest
            log.exception("model %s: an encoder pass of %d inputs failed", self.name, len(items))
            jobs = jobs_of(items)
            for j in jobs:
                self._q.cancel(j)  # their other inputs need not run
            return error_events(jobs, exc)
        took = time.perf_counter() - t0
        self.passes += 1
        self.inputs_done += len(items)
        self.max_batch_seen = max(self.max_batch_seen, len(items))
        _record(self.name, items, mono, took)
        return events_for(items, values)

    def fail_all(self, exc: Exception) -> list[tuple[EncodeJob, Any]]:
        return error_events(self._q.drain(), exc)

    def close(self) -> None:
        self._q.drain()

    # -- subclass API --------------------------------------------------------------------
    @abc.abstractmethod
    def _forward(self, items: list[EncodeItem]) -> list[Any]:
        """One forward pass over ``items``: a result per item, in order."""

    def new_job(self, encoded: list[tuple[list[int], list[int] | None]]) -> EncodeJob:
        return EncodeJob([EncodeItem(i, ids, types) for i, (ids, types) in enumerate(encoded)])

    def warmup(self) -> None:  # noqa: B027 - optional hook; engines with kernels override it
        """Run a few tiny batches through the full path (compiles kernels, fills caches)."""


def _record(model: str, items: list[EncodeItem], started: float, took: float) -> None:
    try:
        from mlxd.observability import metrics
    except Exception:  # noqa: BLE001 - metrics are optional
        return
    metrics.embed_batch_size.labels(model).observe(len(items))
    metrics.embed_inference_duration.labels(model).observe(took)
    q = metrics.embed_queue_duration.labels(model)
    for it in items:
        q.observe(max(started - it.t_queued, 0.0))


# -- tokenizers ------------------------------------------------------------------------------


class TextTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer, safe to share across threads.

    The checkpoint's own padding/truncation settings are switched off; truncation, when a
    request allows it, uses a second copy with truncation at ``max_length`` (so no call
    mutates shared state).
    """

    def __init__(self, path: Path, max_length: int) -> None:
        tok = load_tokenizer(path)
        tok.no_padding()
        tok.no_truncation()
        self.max_length = max_length
        self._plain = tok
        from tokenizers import Tokenizer

        self._trunc = Tokenizer.from_str(tok.to_str())
        self._trunc.enable_truncation(max_length, strategy="longest_first")
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def encode(
        self,
        texts: list[str],
        *,
        truncate: bool,
        param: str = "input",
        positions: list[int] | None = None,
        many: bool | None = None,
    ) -> list[list[int]]:
        """Token ids per text; ``positions`` (the texts' indices in the request) and
        ``many`` only shape the error message of an input that is too long."""
        encs = self._plain.encode_batch(texts) if len(texts) > 1 else [self._plain.encode(texts[0])]
        out = []
        for i, e in enumerate(encs):
            ids = e.ids
            if len(ids) > self.max_length:
                if not truncate:
                    raise too_long(
                        positions[i] if positions else i,
                        len(ids),
                        self.max_length,
                        param,
                        len(texts) > 1 if many is None else many,
                    )
                ids = self._trunc.encode(texts[i]).ids
            out.append(list(ids))
        return out

    def encode_pairs(
        self, first: str, seconds: list[str], *, truncate: bool, param: str = "documents"
    ) -> list[tuple[list[int], list[int]]]:
        pairs = [(first, s) for s in seconds]
        encs = self._plain.encode_batch(pairs)
        out = []
        for i, e in enumerate(encs):
            if len(e.ids) > self.max_length:
                if not truncate:
                    raise too_long(
                        i,
                        len(e.ids),
                        self.max_length,
                        param,
                        True,
                        what="query and document together",
                    )
                e = self._trunc.encode(*pairs[i])
            out.append((list(e.ids), list(e.type_ids)))
        return out

    def tokenize(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [
            list(e.ids)
            for e in self._plain.encode_batch(texts, add_special_tokens=add_special_tokens)
        ]

    def token_strings(self, ids: list[int]) -> list[str]:
        return [self._plain.id_to_token(i) or "" for i in ids]


def too_long(
    i: int, n: int, limit: int, param: str, many: bool, what: str = "input"
) -> ContextLengthExceeded:
    where = f"{param}[{i}]" if many else param
    return ContextLengthExceeded(
        f"{where}: the {what} has {n} tokens, more than this model's maximum of {limit}; "
        "shorten it or send truncate: true",
        param=where,
    )


def load_tokenizer(path: Path) -> Any:
    """``tokenizer.json`` if present, else transformers' fast tokenizer built from the
    legacy files (vocab.txt, sentencepiece.bpe.model...)."""
    from tokenizers import Tokenizer

    f = Path(path) / "tokenizer.json"
    if f.is_file():
        return Tokenizer.from_file(str(f))
    try:
        from transformers import AutoTokenizer

        fast = AutoTokenizer.from_pretrained(str(path), use_fast=True)
        return Tokenizer.from_str(fast.backend_tokenizer.to_str())
    except Exception as exc:  # noqa: BLE001 - one clear error
        raise InvalidRequest(
            f"{path}: no usable tokenizer (tokenizer.json or a transformers fast tokenizer): {exc}"
        ) from exc


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
