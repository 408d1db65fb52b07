"""mlx-lm's continuous batch as the engine core runs it: prefill keeps MLX's buffer cache,
finished rows may leave the decode batch together rather than one step each, and the
batch says how many newcomers make a clean prefill group.

mlx-lm's ``PromptProcessingBatch.prompt`` calls ``mx.clear_cache()`` after every prefill
chunk, which suits a script that prefills once and then decodes. In a server, newcomers
are prefilled while a decode batch runs, every few steps under load, and each clear hands
every cached buffer back to the device allocator (on CUDA a ``cudaFree``, which waits for
the device), so the decode steps that follow allocate their buffers anew. Here the buffer
cache is cleared only when it holds more than :data:`CACHE_KEEP_BYTES` (a long prompt's
chunk can leave big attention buffers behind) and when the batch runs dry (the engine
clears it then: engines/llm.py), so memory at rest is what mlx-lm leaves.

Finished rows (``defer_leaves``, on a GPU): mlx-lm filters its decode batch in the step a
row finishes, and ``BatchKVCache.filter`` reads every layer's left padding back to the
host (``tolist``), which waits for the decode step just dispatched: the step's host work
no longer overlaps the device's, and the next step meets a new batch shape. Behind HTTP
rows finish one by one, so the core met two to three times as many such steps as the
engine alone, whose rows finish in waves (on an H200 a step in which rows leave cost
about three decode steps). Here a finished row stays in the
batch, decoding tokens nobody reads, until the batch is reshaped anyway (newcomers join,
which already waits for the device; a client goes away) or the finished rows are as many
as the live ones; a decode step of a host-bound GPU costs the same with a few more rows.
On the CPU a row costs its arithmetic, so there rows leave at once, as in mlx-lm.

With ``prompt_end`` (a model engines/prompt_end.py checked), the scheduler's step is mlx-lm's
but for a prompt's last token: it goes into the last prefill chunk, the first token is
sampled from that pass (:func:`prefilled_group`), and the group joins the decode batch in
the same step, where mlx-lm feeds that token in a pass of its own a step later.

A step's token budget (``max_step_tokens``, engine.max_step_tokens): mlx-lm prefills one
chunk of ``prefill_step_size`` tokens for every prompt in its prompt batch per step, so a
step beside running streams could carry eight 512-token chunks and hold every stream's
next token back by all of them. Here the step's decode rows count first (a verify step's
drafted tokens too), and what is left of the budget is shared equally among the prompts
being prefilled: one chunk length for all of them, since a prefill pass is padded to its
longest chunk and costs rows x longest. A prompt still gets
:data:`MIN_PREFILL_TOKENS` when decode rows fill the budget, and the prompt batch takes in
no more newcomers than the budget feeds that many tokens each, so every prompt progresses
every step. Chunk boundaries change what a prompt is prefilled with per pass, not its
tokens: greedy output is the same (float noise aside) at any budget. With ``pace``
(engines/step_pace.py, 'auto' on the CPU) the budget beside decoding rows is steered from
the steps' measured times instead of fixed.

Checkpoints (``checkpoint_tokens``, for models with recurrent or sliding-window layers and
a prefix cache): after a step's prefill, each row that has advanced that many tokens since
its last checkpoint, or that has reached its prompt's end, has those layers' state copied
(engines/prefix_cache.py's ``snapshot_row``) and kept under its uid until the engine hands
them to the prefix cache with the finished sequence (:meth:`take_checkpoints`).

Pipelined decode (``pipeline``, engine.pipeline_decode): mlx-lm's ``GenerationBatch._step``
builds step n+1's forward pass on step n's sampled tokens while they are still lazy and
``async_eval`` s it before it reads step n's tokens to the host, as ``generate_step`` does,
so the host's bookkeeping and the next step's graph building overlap the device. A row
that finishes at step n has step n+1 in flight: its token is never read and its cache
entry goes with the row (a held row decodes unseen anyway). A logits processor gets step
n's token lazily in its context; one that needs it on the host (a grammar) reads it, which
waits for step n before step n+1 is built: such a batch runs one step at a time by itself.
With ``pipeline`` off, each step's tokens are evaluated before the step returns: the same
graph and tokens, without the overlap (to measure what it is worth).

A batch whose rows carry no left padding (one row, or rows of one length) decodes without
an attention mask (``maskless_decode``): mlx-lm's batch cache builds one every step (a
causal mask against each row's left padding), which then masks nothing at one token a row.
On the CPU the engine ran 1.06x (one row) and 1.14x (four unpadded rows) without it
(docs/benchmarks.md, pipelined decode). The padding is read when the rows change (from the
host's copy in a row pool, from an evaluated array otherwise).

Everything else is mlx-lm's: the batch's right padding, chunking by
``prefill_step_size`` and the caches' ``prepare``/``finalize`` protocol. The group rule
(:meth:`ServingBatchGenerator.clean_group_room`) reads mlx-lm's queue and prompt batch,
which is why it lives here, beside the subclass, and not in the engine.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from mlxd.engines.kv_quant import KVQuant, for_batch, joined_kinds, quantized_when_due
from mlxd.engines.kv_rows import RowPoolKVCache, filter_pools, join_caches, poolable
from mlxd.engines.lora import set_rows
from mlxd.engines.mixed_step import MOST_MIXED_TOKENS, mixable, mixed_forward
from mlxd.engines.prefix_cache import snapshot_row
from mlxd.engines.prompt_end import last_logits
from mlxd.engines.step_pace import MIN_PREFILL_TOKENS, StepPace

CACHE_KEEP_BYTES = 1 << 30
# engine.max_step_tokens 'auto', per backend (config.py's description says why): on the
# CPU the budget before StepPace has measured the steps
AUTO_STEP_TOKENS = {"gpu": 0, "cpu": 256}


def step_budget(setting: int | str, on_gpu: bool) -> int:
    """engine.max_step_tokens as a number: 'auto' per backend; 0 is no budget."""
    if setting == "auto":
        return AUTO_STEP_TOKENS["gpu" if on_gpu else "cpu"]
    return int(setting)


@dataclass
class StepStats:
    """What the budgeted steps carried (the engine's stats: /health, /api/ps): tokens fed
    per step, padding included, so an operator can see the bound hold."""

    budget: int = 0  # with 'auto' on the CPU: the latest step's, from measured costs
    adaptive: bool = False
    steps: int = 0
    prefill_steps: int = 0
    prefill_tokens: int = 0
    largest_step_tokens: int = 0
    largest_prefill_tokens: int = 0
    mixed: bool = False  # prefill may go into the decode pass (engines/mixed_step.py)
    mixed_steps: int = 0  # steps whose prefill did

    def record(self, decode: int, prefill: int) -> None:
        self.steps += 1
        if prefill:
            self.prefill_steps += 1
            self.prefill_tokens += prefill
        self.largest_step_tokens = max(self.largest_step_tokens, decode + prefill)
        self.largest_prefill_tokens = max(self.largest_prefill_tokens, prefill)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def trim_buffer_cache(limit: int | None = None) -> None:
    """Clear MLX's buffer cache only when it holds more than ``limit`` bytes (default
    :data:`CACHE_KEEP_BYTES`)."""
    if mx.get_cache_memory() > (CACHE_KEEP_BYTES if limit is None else limit):
        mx.clear_cache()


class ServingPromptBatch(PromptProcessingBatch):
    """mlx-lm's prompt batch whose prefill trims the buffer cache instead of clearing it."""

    def prompt(self, tokens: list[list[int]]) -> None:
        self._prefill(tokens, last=False)

    def prompt_end(self, tokens: list[list[int]]) -> mx.array:
        """Prefill ``tokens`` (each row's last prompt tokens, up to and including its last
        token) in one forward pass, returning the logits at each row's last position
        (engines/prompt_end.py): ``[rows, vocab]``."""
        logits = self._prefill(tokens, last=True)
        assert logits is not None
        return logits

    def _prefill(self, tokens: list[list[int]], last: bool) -> mx.array | None:
        if len(self.uids) != len(tokens):
            raise ValueError("The batch length doesn't match the number of inputs")
        if not tokens:
            return None
        for held, new in zip(self.tokens, tokens, strict=True):
            held += new  # what the KV cache will hold, as mlx-lm keeps it
        set_rows(self.model, self.uids)  # each row's LoRA adapter (engines/lora.py)
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
        logits = None
        if last:  # one pass: the scheduler's chunk plus the last token
            logits = last_logits(self.model, inputs, self.prompt_cache, [n - 1 for n in lengths])
            mx.eval(logits, [c.state for c in self.prompt_cache])
            trim_buffer_cache()
        else:
            step = self.prefill_step_size
            for start in range(0, longest, step):
                self.model(inputs[:, start : start + step], cache=self.prompt_cache)
                mx.eval([c.state for c in self.prompt_cache])
                trim_buffer_cache()
        if padded:
            for c in self.prompt_cache:
                c.finalize()
            mx.eval([c.state for c in self.prompt_cache])
        return logits


class ServingGenerationBatch(GenerationBatch):
    """mlx-lm's decode batch whose finished rows can stay until a reshape (see the module
    docstring). ``len()`` counts the live rows only: it is what mlx-lm's scheduler and the
    engine read as the running batch."""

    defer_leaves = False
    pipeline = True  # False: the next step's tokens are evaluated before next() returns
    maskless_decode = True  # no attention mask while no row has left padding

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._finished: set[int] = set()  # uids of finished rows still in the batch
        self._unpadded: bool | None = None  # None: not read since the rows last changed
        super().__init__(*args, **kwargs)

    def _step(self) -> tuple[list[int], list[mx.array]]:
        """mlx-lm's step; without its attention mask while no row is padded."""
        set_rows(self.model, self.uids)  # each row's LoRA adapter (engines/lora.py)
        if self._unpadded is None and self.maskless_decode:
            self._unpadded = unpadded(self.prompt_cache)
            if self._unpadded:
                for c in self.prompt_cache:
                    c.make_mask = DecodeWithoutMask(c)
        return super()._step()

    def _rows_change(self) -> None:
        """Before the rows change: the caches get their own mask back until read again."""
        if self._unpadded:
            for c in self.prompt_cache:
                c.__dict__.pop("make_mask", None)
        self._unpadded = None

    def __len__(self) -> int:
        return len(self.uids) - len(self._finished)

    def next(self) -> list[GenerationBatch.Response]:
        """mlx-lm's step and finish rules; a finished row answers once and then decodes
        unseen until the batch is compacted."""
        if not self.uids:
            return []
        tokens, logprobs = self._step()
        if not self.pipeline:
            mx.eval(self._next_tokens, self._next_logprobs)
        done = self._finished
        responses = []
        finished_now = []
        for i, uid in enumerate(self.uids):
            if uid in done:
                continue
            finish = None
            self._num_tokens[i] += 1
            if self._num_tokens[i] >= self.max_tokens[i]:
                finish = "length"
            if self._matchers[i].advance(tokens[i]):
                finish = "stop"
            if finish is None:
                responses.append(self.Response(uid, tokens[i], logprobs[i], None, None, None))
                continue
            # a copy: a row left in the batch goes on appending to its token list
            responses.append(
                self.Response(
                    uid, tokens[i], logprobs[i], finish, self.extract_cache(i), list(self.tokens[i])
                )
            )
            done.add(uid)
            finished_now.append(i)
        if done and (not self.defer_leaves or len(done) >= len(self)):
            self.filter([i for i, uid in enumerate(self.uids) if uid not in done])
        elif finished_now:
            self._quiet(finished_now)
        return responses

    def _quiet(self, rows: list[int]) -> None:
        """Rows just finished and held: they run no logits processors (a grammar past its
        end, a penalty's bookkeeping) and sample with a live row's sampler, so that they
        neither fail nor keep the batch off mlx-lm's one batched sampler. Once per row:
        a held row keeps what it was given here until the batch is compacted."""
        done = self._finished
        live = next(i for i, uid in enumerate(self.uids) if uid not in done)
        for i in rows:
            if self.logits_processors:
                self.logits_processors[i] = []
            if self.samplers:
                self.samplers[i] = self.samplers[live]

    def filter(self, keep: list[int]) -> None:
        """mlx-lm's filter, which also drops every finished row still held. Over a
        :class:`RowPoolKVCache` the rows kept are reordered so that only the last ones
        move, into the holes the others leave."""
        self._rows_change()
        done = self._finished
        if done:
            keep = [i for i in keep if self.uids[i] not in done]
            done.clear()
        caches = self.prompt_cache
        if keep and caches and all(isinstance(c, RowPoolKVCache) for c in caches):
            keep = fill_order(keep)
            filter_pools(caches, keep)  # every layer's rows that move, read out at once
            self.prompt_cache = []  # so that mlx-lm's filter leaves them be
            super().filter(keep)
            self.prompt_cache = caches
            return
        super().filter(keep)

    def compact(self) -> None:
        """Drop the finished rows held."""
        if self._finished:
            self.filter(list(range(len(self.uids))))

    def extend(self, batch: Any) -> None:
        """Newcomers join: drop the finished rows first (the join step already waits for
        the device, in mlx-lm's split of the prompt batch). Plain KV caches join as
        :class:`RowPoolKVCache` s, written into spare rows (engines/kv_rows.py)."""
        self.compact()
        self._rows_change()
        mine, theirs = self.prompt_cache, batch.prompt_cache
        if (
            mine
            and theirs
            and all(map(poolable, mine + theirs))
            and all(c.keys is not None for c in mine)
        ):
            self.prompt_cache = [join_into(c, o) for c, o in zip(mine, theirs, strict=True)]
            batch.prompt_cache = []  # taken: mlx-lm's extend then keeps ours
        super().extend(batch)


def unpadded(caches: list[Any]) -> bool:
    """Whether every layer's cache is a plain batch cache (mlx-lm's or a row pool) with no
    row left-padded: a one-token step then needs no attention mask."""
    if not caches or not all(type(c) in (BatchKVCache, RowPoolKVCache) for c in caches):
        return False
    for c in caches:
        left = c.left if isinstance(c, RowPoolKVCache) else c.left_padding.tolist()
        if any(left):
            return False
    return True


class DecodeWithoutMask:
    """A cache's ``make_mask`` that gives no mask for a one-token step (nothing to hide
    when no row is padded) and the cache's own mask otherwise."""

    __slots__ = ("cache",)

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def __call__(self, n: int, *args: Any, **kwargs: Any) -> Any:
        if n == 1 and not kwargs.get("return_array"):  # a model that asks for an array gets it
            return None
        return type(self.cache).make_mask(self.cache, n, *args, **kwargs)


def prefilled_group(model: Any, group: PromptProcessingBatch, logits: mx.array) -> GenerationBatch:
    """``group`` (prefilled through each row's last prompt token) as mlx-lm's generation
    batch, its first tokens sampled from ``logits`` (the prefill's last positions).

    mlx-lm's opening step feeds each row's last prompt token in a forward pass and samples
    from its logits (processors with the whole prompt as context, the batch's one sampler
    call or per-row samplers). That step runs here as it is, with ``logits`` standing in
    for its forward pass: the tokens it is given stop before the last prompt token, which
    the step appends, as in mlx-lm. The batch only ever joins the decode batch
    (``extend``), which runs the model from then on.
    """
    batch = GenerationBatch(
        lambda inputs, cache=None: logits[:, None, :],
        group.uids,
        mx.array([t[-1] for t in group.tokens]),
        group.prompt_cache,
        [t[:-1] for t in group.tokens],
        group.samplers,
        group.fallback_sampler,
        group.logits_processors,
        group.stop_sequences,
        group.max_tokens,
    )
    batch.model = model
    return batch


def fill_order(keep: list[int]) -> list[int]:
    """``keep`` reordered so that rows kept below ``len(keep)`` stay where they are and
    the rows kept above it fill the holes, in order: the fewest rows move."""
    k = len(keep)
    kept = set(keep)
    movers = iter(sorted(i for i in keep if i >= k))
    return [i if i in kept else next(movers) for i in range(k)]


def join_into(cache: Any, other: Any) -> RowPoolKVCache:
    """``other``'s rows after ``cache``'s: in place when ``cache`` is a pool with room."""
    if isinstance(cache, RowPoolKVCache):
        cache.extend(other)
        return cache
    return join_caches(cache, other)


class ServingBatchGenerator(BatchGenerator):
    """mlx-lm's BatchGenerator with :class:`ServingPromptBatch` as its prompt batch and
    :class:`ServingGenerationBatch` as its decode batch.

    Newcomers are merged into the one prompt batch made here (``extend``), and split off
    from it by copies of its class, so this one instance decides how every prefill runs;
    they join the one decode batch made here, which every step runs.

    With ``kv_quant`` (engine.kv_bits), every sequence's plain KV layers enter the batch
    as quantized caches (engines/kv_quant.py), a prefix-cache hit's too.
    """

    def __init__(
        self,
        model: Any,
        *,
        defer_leaves: bool = False,
        pipeline: bool = True,
        prompt_end: bool = False,
        max_step_tokens: int = 0,
        pace: StepPace | None = None,
        checkpoint_tokens: int | None = None,
        kv_quant: KVQuant | None = None,
        mixed: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, **kwargs)
        self.kv_quant = kv_quant
        self.mixed = mixed  # decode and prefill in one pass (engines/mixed_step.py)
        # None: no checkpoints; 0: at each prompt's end only (see the module docstring)
        self.checkpoint_tokens = checkpoint_tokens
        self._checkpoints: dict[int, dict[int, list[Any]]] = {}  # uid -> position -> states
        self.prompt_end = prompt_end
        self.max_step_tokens = max_step_tokens  # 0: no budget, mlx-lm's chunks
        self.pace = pace  # measured costs set the budget (engines/step_pace.py)
        self.step_stats = StepStats(budget=max_step_tokens, adaptive=pace is not None, mixed=mixed)
        self._prompt_batch = self._empty_prompt_batch()
        batch = ServingGenerationBatch.empty(self.model, self.sampler)
        batch.defer_leaves = defer_leaves
        batch.pipeline = pipeline
        self._generation_batch = batch

    def insert_segments(
        self,
        segments: list,
        max_tokens: Any = None,
        caches: list | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        q = self.kv_quant
        if q is not None:
            caches = [
                for_batch(c if c is not None else make_prompt_cache(self.model), q)
                for c in (caches or [None] * len(segments))
            ]
        return super().insert_segments(segments, max_tokens, caches, *args, **kwargs)

    def _empty_prompt_batch(self) -> ServingPromptBatch:
        return ServingPromptBatch.empty(
            self.model, self.sampler, prefill_step_size=self.prefill_step_size
        )

    def _prefill_left(self, decode_tokens: int) -> int | None:
        """The prefill tokens a step may carry beside ``decode_tokens``; None: unbounded."""
        if self.pace is not None:
            left = self.pace.prefill_tokens(decode_tokens)
            self.step_stats.budget = decode_tokens + (left or 0)
            return left
        if not self.max_step_tokens:
            return None
        return max(self.max_step_tokens - decode_tokens, MIN_PREFILL_TOKENS)

    def _next(self) -> tuple[list, list]:
        """:meth:`_step_once`, timed for the measured budget (engines/step_pace.py)."""
        if self.pace is None:
            return self._step_once()
        decode = len(self._generation_batch.uids)
        fed = self.step_stats.prefill_tokens
        tic = time.perf_counter()
        out = self._step_once()
        prefill = self.step_stats.prefill_tokens - fed
        self.pace.observe(decode, prefill, time.perf_counter() - tic)
        return out

    def _prompt_rows(self, left: int | None) -> int:
        """How many prompts the prompt batch may prefill together under ``left``."""
        if left is None:
            return self.prefill_batch_size
        return min(self.prefill_batch_size, max(left // MIN_PREFILL_TOKENS, 1))

    def _step_once(self) -> tuple[list, list]:
        """mlx-lm's step under the token budget (see the module docstring): the decode
        step, newcomers into the prompt batch, one chunk each for the prompts being
        prefilled, as long as the budget's share allows.

        With ``prompt_end`` (a model :func:`supports_prompt_end`), a prompt's last token
        goes into its last prefill chunk and the row joins the decode batch in the same
        step, its first token sampled from that pass (engines/prompt_end.py): no pass of
        its own for the last token, and the first token a step earlier. Otherwise as
        mlx-lm's: a row prefilled up to its last token joins the decode batch the next
        step, in a pass of that token.

        With ``mixed`` (engines/mixed_step.py), the chunks are chosen before the decode
        step and, when the prompts' chunks are of one length, go into the decode step's
        forward pass."""
        prompt_responses: list = []
        generation_responses: list = []
        batch = self._generation_batch
        if len(batch) > 0:
            batch.prompt_cache = quantized_when_due(batch.prompt_cache, self.kv_quant)
            if self._mixes(batch):
                return self._mixed_step(batch)
            generation_responses, fed = self._decode(batch)
        else:
            fed = 0
        if len(batch) >= self.completion_batch_size:
            self.step_stats.record(fed, 0)
            return prompt_responses, generation_responses
        rows, chunks, ends, finals = self._plan(fed, prompt_responses)
        self._prefill(rows, chunks, ends, finals)
        return prompt_responses, generation_responses

    def _decode(self, batch: Any) -> tuple[list, int]:
        """The decode batch's step, timed; with the tokens it fed the model."""
        counters = self._counters
        fed = len(batch.uids)  # held finished rows decode too
        tic = time.perf_counter()
        responses = batch.next()
        counters.decode_time += time.perf_counter() - tic
        counters.generation_tokens += len(responses)
        counters.generation_steps += 1
        if counters.generation_steps % 512 == 0:
            mx.clear_cache()
        return responses, getattr(batch, "fed_tokens", fed)  # a verify step's drafts count

    def _plan(self, fed: int, prompt_responses: list) -> tuple[list, list, list, list]:
        """Newcomers into the prompt batch under the budget left beside ``fed`` decode
        tokens, rows prefilled up to their last token into the decode batch (mlx-lm's
        path), and this step's chunk of every prompt being prefilled: the rows, their
        chunks, whether each prompt ends with its chunk, and whether its prefill is done."""
        batch = self._generation_batch
        staying = len(self._currently_processing) - len(self._joining())
        left = self._prefill_left(fed + len(self._currently_processing) - staying)
        n = min(
            self.prefill_batch_size - len(self._prompt_batch),
            self._prompt_rows(left) - staying,
            self.completion_batch_size - len(batch),
            len(self._unprocessed_sequences),
        )
        if n > 0:
            self._extend(self._prompt_batch, self._make_batch(n))
        joining = self._joining()
        if joining:  # mlx-lm's split: these rows' last tokens go in the decode pass
            self._join(joining, prompt_responses)
            fed += len(joining)
            left = self._prefill_left(fed)
        rows = self._currently_processing
        prompts = self._prompt_batch
        chunks, ends, finals = [], [], []
        size = self.prefill_step_size
        if left is not None and rows:
            most = size if self.pace is None else max(size, self.pace.most)
            size = max(min(most, left // len(rows)), 1)
        for uid, seq in zip(prompts.uids, rows, strict=True):
            segments = seq[0]
            chunk = segments[0][:size]
            segments[0] = segments[0][len(chunk) :]
            end_of_segment = not segments[0]
            if end_of_segment:
                segments.pop(0)
            if (
                self.prompt_end
                and len(segments) == 1
                and len(segments[0]) == 1
                and (left is None or len(chunk) < size)
            ):
                chunk = chunk + segments.pop()  # the last token mlx-lm split off at insert
            seq[1] += len(chunk)
            chunks.append(chunk)
            ends.append(not segments)
            # the row's prefill is done (mlx-lm's path feeds the last token when it joins)
            finals.append(not segments or (len(segments) == 1 and len(segments[0]) == 1))
            prompt_responses.append(
                PromptProcessingBatch.Response(uid, (seq[1], seq[2]), end_of_segment, not segments)
            )
        self._counters.prompt_tokens += sum(len(c) for c in chunks)
        self.step_stats.record(fed, len(chunks) * max(map(len, chunks), default=0))
        return rows, chunks, ends, finals

    def _prefill(self, rows: list, chunks: list, ends: list, finals: list) -> None:
        """The planned chunks in a prefill pass of their own."""
        if not chunks:
            return
        prompts = self._prompt_batch
        tic = time.perf_counter()
        if not any(ends):
            prompts.prompt(chunks)
            self._checkpoint(prompts, finals)
            prompts.prompt_cache = quantized_when_due(prompts.prompt_cache, self.kv_quant)
        else:
            logits = prompts.prompt_end(chunks)
            self._checkpoint(prompts, finals)
            self._ended(rows, ends, logits)
        self._counters.prompt_time += time.perf_counter() - tic

    def _ended(self, rows: list, ends: list, logits: mx.array) -> None:
        """The prompts whose prefill ended (``ends``) join the decode batch, their first
        tokens sampled from ``logits`` (their last positions)."""
        prompts = self._prompt_batch
        done = [i for i, end in enumerate(ends) if end]
        if len(done) == len(ends):
            group, self._prompt_batch = prompts, self._empty_prompt_batch()
        else:  # a longer prompt goes on: mlx-lm's split (copies the caches)
            group, logits = prompts.split(done), logits[mx.array(done)]
        self._currently_processing = [s for s, end in zip(rows, ends, strict=True) if not end]
        self._extend(self._generation_batch, prefilled_group(self.model, group, logits))

    def _mixes(self, batch: Any) -> bool:
        """Whether this step's prefill may go into the decode step's pass: prompts to
        prefill, room in the batch, the first token from the prefill pass (no rows
        joining through mlx-lm's pass) and no checkpoints to take between chunks."""
        return (
            self.mixed
            and self.prompt_end
            and self.checkpoint_tokens is None
            and len(batch) < self.completion_batch_size
            and bool(self._currently_processing or self._unprocessed_sequences)
            and mixable(batch.prompt_cache)
        )

    def _mixed_step(self, batch: Any) -> tuple[list, list]:
        """The chunks chosen first, then the decode step with them in its forward pass
        (engines/mixed_step.py); chunks of unequal length (a prompt ending), more than
        :data:`MOST_MIXED_TOKENS` tokens, or caches that cannot mix go in a pass of their
        own after the decode step, as without ``mixed``. The decode step's tokens count
        as what a plain step feeds, since its kind (plain or verify) is known only when it
        runs."""
        prompt_responses: list = []
        rows, chunks, ends, finals = self._plan(len(batch.uids), prompt_responses)
        prompts = self._prompt_batch
        if (
            not chunks
            or len({len(c) for c in chunks}) > 1
            or len(chunks) * len(chunks[0]) > MOST_MIXED_TOKENS
            or not mixable(prompts.prompt_cache)
        ):
            generation_responses, _ = self._decode(batch)
            self._prefill(rows, chunks, ends, finals)
            return prompt_responses, generation_responses
        for held, new in zip(prompts.tokens, chunks, strict=True):
            held += new  # what the KV cache will hold, as the prompt batch keeps it
        inputs, last = mx.array(chunks), any(ends)
        prompt_logits: list[mx.array | None] = [None]
        model = batch.model

        def forward(decode_inputs: mx.array, cache: list[Any]) -> mx.array:
            logits, prompt_logits[0] = mixed_forward(
                model, decode_inputs, cache, batch.uids, inputs, prompts.prompt_cache,
                prompts.uids, last,
            )  # fmt: skip
            return logits

        batch.model = forward
        try:
            generation_responses, _ = self._decode(batch)
        finally:
            batch.model = model
        tic = time.perf_counter()
        logits = prompt_logits[0]
        mx.eval([c.state for c in prompts.prompt_cache], [] if logits is None else logits)
        trim_buffer_cache()
        self.step_stats.mixed_steps += 1
        if logits is not None:
            self._ended(rows, ends, logits)
        else:
            prompts.prompt_cache = quantized_when_due(prompts.prompt_cache, self.kv_quant)
        self._counters.prompt_time += time.perf_counter() - tic
        return prompt_responses, generation_responses

    def _checkpoint(self, prompts: PromptProcessingBatch, finals: list[bool]) -> None:
        """Checkpoint the rows that reached their prompt's end or advanced
        ``checkpoint_tokens`` since their last checkpoint (or their cached prefix)."""
        every = self.checkpoint_tokens
        if every is None:
            return
        if len(self._checkpoints) > 2 * (self.completion_batch_size + self.prefill_batch_size):
            # rows that ended without handing theirs over (a failed row): not kept forever
            live = {*prompts.uids, *self._generation_batch.uids}
            self._checkpoints = {u: c for u, c in self._checkpoints.items() if u in live}
        for i, (uid, held) in enumerate(zip(prompts.uids, prompts.tokens, strict=True)):
            mine = self._checkpoints.setdefault(uid, {})
            pos = len(held)
            last = max(mine, default=0)
            if pos > last and (finals[i] or (every > 0 and pos - last >= every)):
                mine[pos] = snapshot_row(prompts.prompt_cache, i)

    def take_checkpoints(self, uid: int) -> dict[int, list[Any]] | None:
        """Row ``uid``'s checkpoints, position -> states, handed over once; None when this
        batch takes none."""
        if self.checkpoint_tokens is None:
            return None
        return self._checkpoints.pop(uid, {})

    def _joining(self) -> list[int]:
        """mlx-lm's path: the prompt rows prefilled up to their last token."""
        if self.prompt_end:
            return []
        return [
            i
            for i, (segments, *_) in enumerate(self._currently_processing)
            if len(segments) == 1 and len(segments[0]) == 1
        ]

    def _join(self, split: list[int], prompt_responses: list) -> None:
        """mlx-lm's move of rows prefilled up to their last token into the decode batch,
        whose first pass feeds that token."""
        rows = self._currently_processing
        last_inputs = [rows[i][0][0] for i in split]
        progress = [(rows[i][2],) * 2 for i in split]
        chosen = set(split)
        self._currently_processing = [r for i, r in enumerate(rows) if i not in chosen]
        gen_batch = self._prompt_batch.split(split).generate(last_inputs)
        for uid, p in zip(gen_batch.uids, progress, strict=True):
            prompt_responses.append(PromptProcessingBatch.Response(uid, p, True, True))
        self._extend(self._generation_batch, gen_batch)

    def _extend(self, batch: Any, other: Any) -> None:
        """``batch.extend(other)``, both quantized first when either is (a batch under
        ``kv_quant_start`` holds plain caches until its rows grow past it)."""
        batch.prompt_cache, other.prompt_cache = joined_kinds(
            batch.prompt_cache, other.prompt_cache, self.kv_quant
        )
        batch.extend(other)

    def remove(self, uids: Any, return_prompt_caches: bool = False) -> Any:
        """mlx-lm's remove (a client gone), which indexes the decode batch by ``len()``:
        the finished rows held go first."""
        batch = self._generation_batch
        if isinstance(batch, ServingGenerationBatch):
            batch.compact()
        out = super().remove(uids, return_prompt_caches=return_prompt_caches)
        for uid in uids:  # a row whose cache is handed back keeps them for the engine
            if uid not in (out or {}):
                self._checkpoints.pop(uid, None)
        return out

    def clean_group_room(self) -> int:
        """How many newcomers the batch takes now as one clean prefill group.

        mlx-lm moves queued sequences into its prompt batch up to ``prefill_batch_size``,
        and once a group is prefilled up to its last tokens, the next step moves it into
        the decode batch. Sequences that reach the prompt batch while such a group is still
        there are merged into it first: in one step mlx-lm then copies the batch's caches,
        splits the group off, starts its decoding and prefills the newcomers. On an H200
        such a mixed step cost about twice a clean prefill step, and a server's staggered
        arrivals made a third of its prefill steps mixed where an offline batch's waves
        make none (step traces of both at 16 and 64 clients). So: none while sequences
        still wait in mlx-lm's own queue or a prefilled group is about to join; otherwise
        what the prompt batch has room for. A prompt still mid-prefill (longer than a
        prefill chunk) is no reason to wait: mlx-lm prefills newcomers beside its next
        chunk. With ``prompt_end`` a group joins in its prefill step, so no group is ever
        about to join when this is asked; only mlx-lm's own queue holds newcomers back.
        Under a step budget, no more than the prompt batch prefills together beside the
        decode batch as it is.
        """
        rows = self._currently_processing
        if self._unprocessed_sequences or (
            rows and all(len(segments) == 1 and len(segments[0]) == 1 for segments, *_ in rows)
        ):
            return 0
        left = self._prefill_left(len(self._generation_batch.uids))
        return max(self._prompt_rows(left) - len(rows), 0)
