"""Text generation over mlx-lm with continuous batching.

Everything that touches MLX here runs on the device worker thread; only the tokenizer
helpers (:meth:`LLMEngine.encode_messages`, :meth:`LLMEngine.encode_request`,
:meth:`LLMEngine.encode_prompt`) and :meth:`LLMEngine.prepare` (grammar compilation) may be
called from other threads, so prompts are templated, tokenized and their grammars built
off the worker.

Per sequence, on top of mlx-lm's batch: a sampler and logits processors (engines/sampling),
a grammar that masks the logits every step (engines/structured: structured output and
forced tool calls), text stops (engines/stops), the split of the text into answer,
reasoning and tool calls (engines/tool_calls), and the prefix cache (engines/prefix_cache):
a new sequence starts from the KV cache of the longest prefix an earlier one left behind.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator
from mlx_lm.utils import load as mlx_lm_load

from mlxd.core.errors import InvalidRequest, ModelLoadError
from mlxd.core.types import (
    GenerateRequest,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from mlxd.engines.backend import apply_dtype
from mlxd.engines.prefix_cache import PrefixCache
from mlxd.engines.sampling import build_logits_processors, build_sampler
from mlxd.engines.stops import StopMatcher
from mlxd.engines.structured import (
    JSON_OPTIONS,
    GrammarCompiler,
    GrammarProcessor,
    tool_call_grammar,
)
from mlxd.engines.tool_calls import (
    OutputSplitter,
    ToolFormat,
    fallback_messages,
    template_messages,
    tool_format,
)

log = logging.getLogger(__name__)



@dataclass
class SeqPlan:
    """What :meth:`LLMEngine.prepare` worked out for one request off the worker thread."""

    splitter: OutputSplitter | None = None  # answer / reasoning / tool calls
    matcher: Any = None  # llguidance matcher of the request's grammar
    arm_after: tuple[int, ...] | None = None  # grammar waits for these tokens (think end)


@dataclass(eq=False)
class Sequence:
    """One request's state inside the batch. ``handle`` belongs to the runtime."""

    prompt_tokens: list[int]
    params: SamplingParams
    handle: Any = None
    uid: int = -1
    generated: int = 0
    finished: bool = False
    _t_added: float = 0.0
    plan: SeqPlan | None = None
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    _detok: Any = field(default=None, repr=False)
    _stops: StopMatcher | None = field(default=None, repr=False)

    def usage(self) -> Usage:
        return Usage(prompt_tokens=len(self.prompt_tokens), completion_tokens=self.generated,
                     cached_tokens=self.cached_tokens)


class LLMEngine:
    """One loaded chat/text model and its continuous batch."""

    kind = "chat"

    def __init__(
        self,
        name: str,
        path: Path,
        *,
        max_num_seqs: int = 32,
        prefill_batch_size: int = 8,
        prefill_step_size: int = 512,
        dtype: str = "auto",
        trust_remote_code: bool = False,
        prefix_cache_bytes: int = 0,
    ) -> None:
        self.name = name
        self.path = Path(path)
        try:
            # trust_remote_code: models.trust_remote_code, off unless the operator says so
            model, tokenizer, config = mlx_lm_load(
                str(self.path), return_config=True, trust_remote_code=trust_remote_code,
                tokenizer_config={"trust_remote_code": trust_remote_code},
            )
        except Exception as exc:  # mlx-lm raises ValueError, FileNotFoundError, KeyError...
            raise ModelLoadError(f"could not load model '{name}' from {path}: {exc}") from exc
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.dtype = self._apply_dtype(dtype)
        self.vocab_size = int(config.get("vocab_size") or len(tokenizer))
        self.context_length = _context_length(config, tokenizer)
        self.eos_token_ids = sorted(tokenizer.eos_token_ids)
        self._settings = dict(
            max_num_seqs=max_num_seqs,
            prefill_batch_size=prefill_batch_size,
            prefill_step_size=prefill_step_size,
        )
        self._gen = self._new_generator()
        self._seqs: dict[int, Sequence] = {}
        self._pending: list[Sequence] = []
        self._step_ema = 0.005  # seconds per decode step, for admission (see _admit)
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self.grammar = GrammarCompiler(tokenizer, self.vocab_size, self.eos_token_ids)
        self.tool_format: ToolFormat = tool_format(tokenizer)
        self.max_batch_seen = 0
        self.steps = 0
        mx.eval(self.model.parameters())
        self.nbytes = sum(v.nbytes for _, v in _tree_leaves(self.model.parameters()))

    # -- construction helpers ------------------------------------------------------------
    def _apply_dtype(self, dtype: str) -> str:
        """Cast half-precision float weights up where the backend is much faster in float32."""
        return apply_dtype(self.model, self.config, dtype)

    def _new_generator(self) -> BatchGenerator:
        """Built on the worker thread, on *that thread's* default stream.

        mlx-lm's module-level ``generation_stream`` is created by whichever thread imports
        mlx_lm first; running the batch on a stream of another thread makes MLX synchronise
        across threads on every step (mlx_lm.server avoids it the same way).
        """
        s = self._settings
        return BatchGenerator(
            self.model,
            stream=mx.default_stream(mx.default_device()),
            max_tokens=1,
            stop_tokens=[[t] for t in self.eos_token_ids],
            completion_batch_size=s["max_num_seqs"],
            prefill_batch_size=min(s["prefill_batch_size"], s["max_num_seqs"]),
            prefill_step_size=s["prefill_step_size"],
        )

    # -- thread-safe tokenizer helpers ---------------------------------------------------
    def encode_messages(self, messages: list[dict], **template_kwargs: Any) -> list[int]:
        if not getattr(self.tokenizer, "has_chat_template", False):
            raise InvalidRequest(
                f"model '{self.name}' has no chat template; use /v1/completions", param="model"
            )
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, **template_kwargs
            )
        except Exception as exc:  # jinja2 TemplateError, KeyError on odd messages...
            raise InvalidRequest(f"chat template failed: {exc}", param="messages") from exc
        return list(ids)

    def encode_request(self, req: GenerateRequest) -> list[int]:
        """A chat request's prompt: its messages, tools and template variables, templated.

        A template that does not render tools gets them (and earlier calls and results) in
        the fallback syntax of engines/tool_calls.py.
        """
        messages = req.messages or []
        kwargs = dict(req.template_kwargs or {})
        tools = req.tools if req.tools and req.tool_choice != "none" else None
        if not self.tool_format.native and (tools or any(
                m.get("role") == "tool" or m.get("tool_calls") for m in messages)):
            messages = fallback_messages(messages, tools)
        elif tools:
            kwargs["tools"] = tools
        return self.encode_messages(template_messages(messages), **kwargs)

    def prepare(self, req: GenerateRequest, tokens: list[int]) -> SeqPlan | None:
        """Grammar and output parsing for one request (any thread; 400s come from here)."""
        tok = self.tokenizer
        chat = req.messages is not None
        tools = req.tools if req.tools and req.tool_choice != "none" else None
        fmt = self.tool_format if tools else None
        think = (tok.think_start, tok.think_end) if chat and tok.has_thinking else None
        reasoning = think is not None and \
            tok.rfind_think_start(tokens) > tok.rfind_think_end(tokens)
        splitter = None
        if think is not None or fmt is not None:
            splitter = OutputSplitter(think=think, reasoning=reasoning, fmt=fmt, tools=tools,
                                      parallel=req.parallel_tool_calls)
        grammar, param = None, "response_format"
        if fmt is not None and req.tool_choice in ("required", "function"):
            names = [t.get("function", t).get("name") for t in tools or []]
            if req.tool_choice == "function":
                if req.tool_name not in names:
                    raise InvalidRequest(f"tool_choice names '{req.tool_name}', which is not "
                                         "among the tools", param="tool_choice")
                names = [req.tool_name]
            grammar = tool_call_grammar(self.grammar, fmt, tools or [], names,
                                        req.parallel_tool_calls and req.tool_choice == "required")
            param = "tool_choice"
        elif req.constraint is not None:
            c = req.constraint
            grammar = self.grammar.from_constraint(c)
            if fmt is not None and fmt.json_body and c.kind in ("json_object", "json_schema"):
                # tool_choice "auto": the answer follows the schema, or the model calls tools
                schema = json.loads(c.spec) if c.kind == "json_schema" else {"type": "object"}
                if isinstance(schema, dict):
                    self.grammar.matcher(grammar)  # the schema alone must be supported
                    answer = "%json " + json.dumps({"x-guidance": JSON_OPTIONS, **schema})
                    names = [t.get("function", t).get("name") for t in tools or []]
                    grammar = tool_call_grammar(self.grammar, fmt, tools or [], names,
                                                req.parallel_tool_calls, answer=answer)
        matcher = self.grammar.matcher(grammar, param) if grammar is not None else None
        arm = tuple(tok.think_end_tokens) if matcher is not None and reasoning else None
        if splitter is None and matcher is None:
            return None
        return SeqPlan(splitter=splitter, matcher=matcher, arm_after=arm)

    def encode_prompt(self, prompt: str) -> list[int]:
        ids = self.tokenizer.encode(prompt)
        bos = getattr(self.tokenizer, "bos_token_id", None)
        # Some tokenizers add BOS twice when the prompt already carries it as text.
        if bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:
            ids = ids[1:]
        return list(ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    # -- worker-thread API ---------------------------------------------------------------
    def new_sequence(self, prompt_tokens: list[int], params: SamplingParams,
                     plan: SeqPlan | None = None) -> Sequence:
        return Sequence(prompt_tokens=prompt_tokens, params=params, plan=plan)

    def add(self, seq: Sequence) -> None:
        """Queue a newcomer; :meth:`_admit` hands newcomers to the batch in groups."""
        p = seq.params
        seq._detok = self.tokenizer.detokenizer
        seq._stops = StopMatcher(p.stop)
        seq._t_added = time.monotonic()
        self._pending.append(seq)

    def _admit(self) -> None:
        """Insert waiting newcomers into the batch, coalescing arrivals into one prefill.

        mlx-lm prefills newcomers in a forward pass of their own that the whole running
        batch waits for. Under load requests trickle in one by one, and prefilling each
        alone stalls every running sequence once per arrival (seen on an H200: half the
        engine's throughput at 64 clients). So while a batch is running, newcomers wait
        until a prefill batch is full or the oldest has waited about two decode steps
        (capped at 25 ms); with nothing running they go at once.
        """
        if not self._pending:
            return
        running = self.num_running
        if running and len(self._pending) < self._settings["prefill_batch_size"]:
            waited = time.monotonic() - self._pending[0]._t_added
            if waited < min(0.025, 2 * self._step_ema):
                return
        batch, self._pending = self._pending, []
        caches = [self._cached_prefix(s) for s in batch]
        uids = self._gen.insert(
            [s.prompt_tokens[s.cached_tokens:] for s in batch],
            max_tokens=[s.params.max_tokens for s in batch],
            caches=caches if any(c is not None for c in caches) else None,
            all_tokens=[list(s.prompt_tokens[:s.cached_tokens]) for s in batch],
            samplers=[build_sampler(s.params, self.vocab_size) for s in batch],
            logits_processors=[self._processors(s) for s in batch],
        )
        for seq, uid in zip(batch, uids, strict=True):
            seq.uid = uid
            self._seqs[uid] = seq

    def _cached_prefix(self, seq: Sequence) -> list[Any] | None:
        """The prefix cache's KV for the start of ``seq``'s prompt (sets cached_tokens)."""
        cache, seq.cached_tokens = None, 0
        if self.prefix_cache.enabled:
            cache, seq.cached_tokens = self.prefix_cache.lookup(seq.prompt_tokens)
        return cache

    def _processors(self, seq: Sequence) -> list:
        processors = build_logits_processors(seq.params)
        if seq.plan is not None and seq.plan.matcher is not None:
            # last, so that nothing after it can lift the grammar's mask
            processors.append(GrammarProcessor(seq.plan.matcher, self.eos_token_ids,
                                               seq.plan.arm_after))
        return processors

    def prefix_cache_stats(self) -> dict[str, int]:
        return self.prefix_cache.stats()

    def next_deadline(self) -> float | None:
        """When held-back newcomers must be admitted even if no step happens before."""
        if not self._pending:
            return None
        return self._pending[0]._t_added + min(0.025, 2 * self._step_ema)

    def cancel(self, seq: Sequence) -> None:
        if seq in self._pending:
            self._pending.remove(seq)
            seq.finished = True
        elif seq.uid in self._seqs:
            self._gen.remove([seq.uid])
            del self._seqs[seq.uid]
            seq.finished = True

    def has_work(self) -> bool:
        return bool(self._seqs) or (bool(self._pending) and (
            self.num_running == 0 or time.monotonic() >= (self.next_deadline() or 0)))

    @property
    def num_running(self) -> int:
        return len(self._gen._generation_batch) if self._gen is not None else 0

    @property
    def num_waiting(self) -> int:
        return len(self._seqs) + len(self._pending) - self.num_running

    def step(self) -> list[tuple[Sequence, TokenEvent]]:
        """One decode step for the running batch plus one prefill chunk for newcomers."""
        self._admit()
        t0 = time.perf_counter()
        _, responses = self._gen.next()
        if responses:
            self._step_ema = 0.8 * self._step_ema + 0.2 * (time.perf_counter() - t0)
        self.steps += 1
        self.max_batch_seen = max(self.max_batch_seen, len(responses))
        out: list[tuple[Sequence, TokenEvent]] = []
        to_remove: list[int] = []
        for r in responses:
            seq = self._seqs.get(r.uid)
            if seq is None:
                continue
            event = self._on_token(seq, r)
            out.append((seq, event))
            if event.finish_reason is not None:
                del self._seqs[r.uid]
                seq.finished = True
                if r.finish_reason is None:  # our text stop: the batch still holds it
                    to_remove.append(r.uid)
                elif r.prompt_cache is not None and self.prefix_cache.enabled:
                    self.prefix_cache.insert(r.all_tokens, r.prompt_cache)
        if to_remove:
            caches = self._gen.remove(to_remove, return_prompt_caches=self.prefix_cache.enabled)
            for cache, tokens in caches.values():
                self.prefix_cache.insert(tokens, cache)
        return out

    def _on_token(self, seq: Sequence, r: Any) -> TokenEvent:
        seq.generated += 1
        detok, stops = seq._detok, seq._stops
        assert stops is not None
        finish = r.finish_reason
        text = ""
        if finish == "stop":  # an EOS token: never shown
            detok.finalize()
            text = detok.last_segment
        else:
            detok.add_token(r.token)
            if finish == "length":
                detok.finalize()
            text = detok.last_segment
        text, hit = stops.feed(text)
        if hit:
            finish = "stop"
        elif finish is not None:
            text += stops.flush()
        event = TokenEvent(text=text, token_ids=[r.token], finish_reason=finish,
                           stop_sequence=stops.matched if hit else None)
        split = seq.plan.splitter if seq.plan is not None else None
        if split is not None:
            event.text, event.reasoning, event.tool_calls = split.feed(text)
            if finish is not None:
                more, reasoning, calls = split.flush()
                event.text += more
                event.reasoning += reasoning
                event.tool_calls += calls
                if finish == "stop" and split.calls:
                    event.finish_reason = finish = "tool_calls"
        if seq.params.logprobs:
            event.logprobs = [self._logprob(r.token, r.logprobs, seq.params.top_logprobs)]
        if finish is not None:
            event.usage = seq.usage()
        return event

    def _logprob(self, token: int, logprobs: mx.array, top: int) -> TokenLogprob:
        entry = TokenLogprob(
            token_id=token,
            token=self.tokenizer.decode([token]),
            logprob=logprobs[token].item(),
        )
        if top > 0:
            idx = mx.argpartition(-logprobs, kth=top - 1)[:top]
            vals = logprobs[idx]
            order = mx.argsort(-vals)
            for i, v in zip(idx[order].tolist(), vals[order].tolist(), strict=True):
                entry.top.append(TopLogprob(i, self.tokenizer.decode([i]), v))
        return entry

    def fail_all(self, exc: Exception) -> list[tuple[Sequence, TokenEvent]]:
        """After an exception inside a step: end every sequence and start a clean batch."""
        out = []
        for seq in [*self._seqs.values(), *self._pending]:
            seq.finished = True
            out.append((seq, TokenEvent(text="", finish_reason="error", error=exc)))
        self._seqs.clear()
        self.prefix_cache.clear()  # may be what filled the memory
        try:
            self._gen.close()
        except Exception:  # noqa: BLE001 - closing a broken generator must not mask exc
            pass
        self._gen = self._new_generator()
        mx.clear_cache()
        return out

    def warmup(self) -> None:
        """One throwaway generation through the batch path, so request one costs what two does."""
        # Through the chat template when there is one: its first rendering compiles the
        # jinja template, which would otherwise land on the first request.
        ids: list[int] = []
        if getattr(self.tokenizer, "has_chat_template", False):
            try:
                ids = self.encode_messages([{"role": "user", "content": "Hello"}])
            except Exception:  # noqa: BLE001 - an odd template must not stop the load
                ids = []
        ids = ids or self.encode_prompt("Hello") or [self.eos_token_ids[0] if self.eos_token_ids
                                                     else 0]
        # A greedy and a sampled row: both sampling paths and a batch of two get exercised.
        seqs = [
            self.new_sequence(ids, SamplingParams(max_tokens=3, temperature=0.0)),
            self.new_sequence(ids, SamplingParams(max_tokens=3, temperature=1.0)),
        ]
        for seq in seqs:
            self.add(seq)
        while self.has_work():
            self.step()
        self.max_batch_seen = 0
        self.steps = 0
        self.prefix_cache = PrefixCache(self.prefix_cache.max_bytes)  # no warm-up entries

    def close(self) -> None:
        """Drop every reference to the weights and caches so their memory really goes back."""
        self._seqs.clear()
        self._pending.clear()
        self.prefix_cache.clear()
        if self._gen is not None:
            self._gen.close()
        self._gen = None
        self.model = None
        mx.clear_cache()


def _context_length(config: dict, tokenizer: Any) -> int:
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
        v = config.get(key) or (config.get("text_config") or {}).get(key)
        if isinstance(v, int) and v > 0:
            return v
    v = getattr(tokenizer, "model_max_length", None)
    if isinstance(v, int) and 0 < v < 10_000_000:
        return v
    return 4096


def _tree_leaves(tree: Any):
    return tree_flatten(tree)
