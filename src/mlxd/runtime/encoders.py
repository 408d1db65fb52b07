"""The encoder request path: embeddings, reranking and token counting.

For each request: admission (the runtime's in-flight limit), input limits, a lease on the
model (loading it on first use), tokenization off the device worker, one
:class:`~mlxd.engines.batching.EncodeJob` submitted to the model's engine, and the results
gathered in input order as the engine's batches finish (a request's inputs may ride in
several batches, next to other callers' inputs). A caller that goes away cancels its
inputs that have not run yet.

Reranking with a *chat* model: the model's loaded chat engine is wrapped in an
:class:`~mlxd.engines.rerank.LLMRerankEngine` that borrows its weights (one scorer per
loaded chat model, attached to the worker next to it, so scoring passes interleave with
the chat model's decode steps). Requests hold the chat model's lease while they score, so
the weights cannot be unloaded under them; a scorer whose model was unloaded is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np

from mlxd.core.errors import (
    EngineError,
    InvalidRequest,
    MlxdError,
    ModelLoadError,
    OutOfMemory,
    PayloadTooLarge,
    QueueFull,
    ShuttingDown,
    Unavailable,
)
from mlxd.core.types import (
    EmbedRequest,
    EmbedResult,
    RerankRequest,
    RerankResult,
    Timings,
    TokenizeResult,
)
from mlxd.observability.context import add_usage, note
from mlxd.runtime.worker import LoopChannel, WorkerDied, is_out_of_memory

log = logging.getLogger(__name__)

# Requests whose text is shorter than this are tokenized right on the event loop (tens of
# microseconds); a thread hop would cost more than it saves. Longer ones go to a thread.
_INLINE_CHARS = 4096


class EncoderService:
    def __init__(self, runtime: Any) -> None:
        self.rt = runtime
        self._scorers: dict[int, tuple[Any, Any]] = {}  # id(LoadedModel) -> (entry, scorer)

    # -- shared steps ----------------------------------------------------------------------
    @property
    def settings(self) -> Any:
        return self.rt.settings

    @contextlib.asynccontextmanager
    async def admitted(self) -> AsyncIterator[None]:
        rt = self.rt
        if getattr(rt, "draining", False):
            raise ShuttingDown()
        if not rt.healthy:
            raise Unavailable(
                "the device worker is not running (restarting); retry shortly",
                headers={"Retry-After": "2"},
            )
        if rt._inflight >= rt.admission_limit:
            raise QueueFull("too many requests queued; retry shortly", headers={"Retry-After": "1"})
        rt._inflight += 1
        try:
            yield
        finally:
            rt._inflight -= 1

    def check_count(self, n: int, param: str) -> None:
        """Empty: 400; more than batch.max_inputs_per_request: 413 (and security.max_inputs,
        when the operator set a lower one: 400)."""
        if n == 0:
            raise InvalidRequest(f"{param} must not be empty", param=param)
        limit = self.settings.batch.max_inputs_per_request
        if n > limit:
            raise PayloadTooLarge(
                f"{param} has {n} items, more than this server accepts in one request "
                f"({limit}); split it into several requests",
                param=param,
            )
        sec_limit = getattr(getattr(self.settings, "security", None), "max_inputs", None)
        if sec_limit is not None and n > sec_limit:
            raise InvalidRequest(
                f"{param} has {n} items, more than this server allows ({sec_limit})", param=param
            )

    async def _off_loop(self, size: int, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        if size <= _INLINE_CHARS:
            return fn(*args, **kw)
        return await asyncio.to_thread(fn, *args, **kw)

    async def _run(self, engine: Any, encoded: list[tuple[list[int], Any]]) -> list[Any]:
        """Submit the inputs as one job and gather its results in input order."""
        return await self.run_job(engine, engine.new_job(encoded))

    async def run_job(self, engine: Any, job: Any) -> list[Any]:
        """Submit ``job`` (an EncodeJob) to ``engine`` and gather its results in order."""
        worker = self.rt.worker
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        encoded = job.items
        job.handle = (LoopChannel(loop), q)
        worker.submit(engine, job)
        out: list[Any] = [None] * len(encoded)
        remaining = len(encoded)
        done = False
        try:
            while remaining:
                ev = await q.get()
                err = getattr(ev, "error", None)
                if err is not None:
                    done = True
                    raise _as_mlxd_error(err)
                for i, v in zip(ev.indices, ev.values, strict=True):
                    if out[i] is None:
                        remaining -= 1
                    out[i] = v
            done = True
            return out
        finally:
            if not done:
                worker.cancel(engine, job)

    # -- embeddings ------------------------------------------------------------------------
    async def embed(self, req: EmbedRequest) -> EmbedResult:
        inputs = req.inputs
        self.check_count(len(inputs), "input")
        for i, x in enumerate(inputs):
            if (isinstance(x, str) and not x) or (not isinstance(x, str) and not len(x)):
                raise InvalidRequest(
                    f"input[{i}] is empty", param=f"input[{i}]" if len(inputs) > 1 else "input"
                )
        if req.dimensions is not None and req.dimensions < 1:
            raise InvalidRequest("dimensions must be at least 1", param="dimensions")
        name = (
            req.model
            if req.model not in (None, "default")
            else self.settings.models.default_embedding
        )
        timings = Timings()
        async with self.admitted():
            lease = await self.rt.models.acquire(name, req.keep_alive)
            try:
                timings.t_acquired = time.perf_counter()
                entry, engine = lease.entry, lease.engine
                note(model=entry.name)
                if entry.kind != "embedding":
                    raise InvalidRequest(
                        f"model '{entry.name}' is a {entry.kind} model and cannot create "
                        f"embeddings; use an embedding model such as "
                        f"'{self.settings.models.default_embedding}'",
                        param="model",
                    )
                if req.dimensions is not None and req.dimensions > engine.dimensions:
                    raise InvalidRequest(
                        f"dimensions is {req.dimensions}, but '{entry.name}' makes "
                        f"{engine.dimensions}-dimensional embeddings",
                        param="dimensions",
                    )
                for i, x in enumerate(inputs):
                    if not isinstance(x, str) and any(not 0 <= t < engine.vocab_size for t in x):
                        raise InvalidRequest(
                            f"input[{i}]: token ids out of range for '{entry.name}'", param="input"
                        )
                size = sum(len(x) for x in inputs if isinstance(x, str))
                encoded = await self._off_loop(
                    size, engine.encode_inputs, inputs, truncate=req.truncate
                )
                values = await self._run(engine, encoded)
                vectors = np.stack(values).astype(np.float32, copy=False)
                if req.dimensions is not None and req.dimensions < vectors.shape[1]:
                    vectors = vectors[:, : req.dimensions]
                    vectors = vectors / np.maximum(
                        np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12
                    )
                ntok = sum(len(ids) for ids, _ in encoded)
                add_usage(entry.name, ntok, 0)
                timings.t_done = time.perf_counter()
                return EmbedResult(entry.name, vectors, ntok, timings)
            finally:
                lease.release()

    # -- reranking -------------------------------------------------------------------------
    async def rerank(self, req: RerankRequest) -> RerankResult:
        self.check_count(len(req.documents), "documents")
        if not req.query:
            raise InvalidRequest("query must not be empty", param="query")
        m = self.settings.models
        name = (
            req.model
            if req.model not in (None, "default")
            else (m.default_reranker or self.rt.models.default_name)
        )
        timings = Timings()
        async with self.admitted():
            lease = await self.rt.models.acquire(name, req.keep_alive)
            try:
                timings.t_acquired = time.perf_counter()
                entry = lease.entry
                note(model=entry.name)
                if entry.kind == "reranker":
                    engine = lease.engine
                elif entry.kind == "chat":
                    engine = self._scorer_for(entry)
                else:
                    raise InvalidRequest(
                        f"model '{entry.name}' is a {entry.kind} model; reranking needs a "
                        "reranker (cross-encoder) or a chat model",
                        param="model",
                    )
                size = len(req.query) * len(req.documents) + sum(map(len, req.documents))
                encode = functools.partial(
                    engine.encode_pairs,
                    req.query,
                    req.documents,
                    truncate=req.truncate,
                    instruction=req.instruction,
                )
                # a chat model's scorer renders the model's chat template around the query:
                # bounded and interrupted with the request, as every render (core/render.py)
                encoded = await (
                    self.rt.renderer.run(encode)
                    if entry.kind == "chat"
                    else self._off_loop(size, encode)
                )
                scores = await self._run(engine, encoded)
                ntok = sum(len(ids) for ids, _ in encoded)
                add_usage(entry.name, ntok, 0)
                timings.t_done = time.perf_counter()
                return RerankResult(entry.name, [float(s) for s in scores], ntok, timings)
            finally:
                lease.release()

    def _scorer_for(self, entry: Any) -> Any:
        """The LLM scorer sharing ``entry``'s chat engine (made and attached on first use)."""
        self._prune()
        found = self._scorers.get(id(entry))
        if found is not None and found[0] is entry:
            return found[1]
        llm = entry.engine
        if getattr(llm, "model", None) is None or getattr(llm, "tokenizer", None) is None:
            raise InvalidRequest(
                f"model '{entry.name}' cannot be used as a reranker", param="model"
            )
        if getattr(llm, "tp_id", 0):
            # its weights are one rank's shard: a forward pass of rank 0 alone would wait
            # for the other ranks' all-reduces forever
            from mlxd.engines import tensor_parallel

            raise InvalidRequest(
                f"model '{entry.name}' is split over the engine's "
                f"{tensor_parallel.mode_name()} ranks and cannot score documents; use a "
                "reranker model",
                param="model",
            )
        from mlxd.engines.encoder import llm_batch_policy
        from mlxd.engines.rerank import LLMRerankEngine

        try:
            scorer = LLMRerankEngine.sharing(llm, llm_batch_policy(self.settings))
        except ModelLoadError as exc:  # the chat model cannot score (no yes/no tokens): 400
            raise InvalidRequest(
                f"model '{entry.name}' cannot be used as a reranker: {exc.message}", param="model"
            ) from exc
        self.rt.worker.attach(scorer)
        self._scorers[id(entry)] = (entry, scorer)
        log.info("model %s: LLM reranker attached (shares the chat model's weights)", entry.name)
        return scorer

    def _prune(self) -> None:
        for key, (entry, scorer) in list(self._scorers.items()):
            if self.rt.models.get_loaded(entry.name) is not entry:
                del self._scorers[key]
                self.rt.worker.detach(scorer)
                self.rt.worker.call(scorer.close)

    def scorers(self) -> list[Any]:
        return [s for _, s in self._scorers.values()]

    # -- token counting --------------------------------------------------------------------
    async def tokenize(
        self,
        model: str | None,
        inputs: list[str] | None,
        messages: list[dict] | None = None,
        *,
        add_special_tokens: bool = True,
        token_strings: bool = False,
        keep_alive: str | int | float | None = None,
    ) -> TokenizeResult:
        if messages is None:
            self.check_count(len(inputs or []), "input")
        elif not messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        lease = await self.rt.models.acquire(model, keep_alive)
        try:
            entry, engine = lease.entry, lease.engine
            note(model=entry.name)
            kind = entry.kind
            if messages is not None:
                if not hasattr(engine, "encode_messages"):
                    raise InvalidRequest(
                        f"messages need a chat model; '{entry.name}' is a {kind} model",
                        param="messages",
                    )
                ids = [await self.rt.renderer.run(engine.encode_messages, messages)]
            else:
                texts = list(inputs or [])
                ids = await asyncio.to_thread(
                    _tokenize_texts, engine, kind, texts, add_special_tokens
                )
            strings = _token_strings(engine, ids) if token_strings else None
            return TokenizeResult(entry.name, kind, ids, int(engine.context_length), strings)
        finally:
            lease.release()


def _tokenize_texts(engine: Any, kind: str, texts: list[str], special: bool) -> list[list[int]]:
    from mlxd.engines.encoder import TextTokenizer

    tok = getattr(engine, "tokenizer", None)
    if isinstance(tok, TextTokenizer):
        return tok.tokenize(texts, add_special_tokens=special)
    if special and hasattr(engine, "encode_prompt"):  # chat and vision models
        return [list(engine.encode_prompt(t)) for t in texts]
    hf = getattr(tok, "_tokenizer", tok)
    if hf is None or not hasattr(hf, "encode"):
        raise InvalidRequest(
            f"model '{getattr(engine, 'name', '?')}' ({kind}) has no tokenizer to count with",
            param="model",
        )
    return [list(hf.encode(t, add_special_tokens=special)) for t in texts]


def _token_strings(engine: Any, ids: list[list[int]]) -> list[list[str]]:
    from mlxd.engines.encoder import TextTokenizer

    tok = getattr(engine, "tokenizer", None)
    if isinstance(tok, TextTokenizer):
        return [tok.token_strings(x) for x in ids]
    hf = getattr(tok, "_tokenizer", tok)
    return [[str(t) for t in hf.convert_ids_to_tokens(x)] for x in ids]


def _as_mlxd_error(err: BaseException) -> MlxdError:
    if isinstance(err, MlxdError):
        return err
    if isinstance(err, WorkerDied):
        return Unavailable(
            f"{err}; it is being restarted, retry shortly", headers={"Retry-After": "2"}
        )
    if is_out_of_memory(err):
        return OutOfMemory(
            f"out of memory while encoding ({err}); retry with fewer or "
            "shorter inputs, or lower batch.max_batch_tokens",
            headers={"Retry-After": "1"},
        )
    return EngineError(f"encoding failed: {err}")
