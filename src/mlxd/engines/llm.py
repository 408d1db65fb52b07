"""Text generation over mlx-lm with continuous batching.

Everything that touches MLX here runs on the device worker thread; only the tokenizer
helpers (:meth:`LLMEngine.encode_messages`, :meth:`LLMEngine.encode_prompt`) may be
called from other threads, so prompts are templated and tokenized off the worker.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator
from mlx_lm.utils import load as mlx_lm_load

from mlxd.core.errors import InvalidRequest, ModelLoadError
from mlxd.core.types import (
    SamplingParams,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from mlxd.engines.backend import wants_float32
from mlxd.engines.sampling import build_logits_processors, build_sampler
from mlxd.engines.stops import StopMatcher

log = logging.getLogger(__name__)

_FLOAT_HALF = (mx.float16, mx.bfloat16)


@dataclass(eq=False)
class Sequence:
    """One request's state inside the batch. ``handle`` belongs to the runtime."""

    prompt_tokens: list[int]
    params: SamplingParams
    handle: Any = None
    uid: int = -1
    generated: int = 0
    finished: bool = False
    _detok: Any = field(default=None, repr=False)
    _stops: StopMatcher | None = field(default=None, repr=False)

    def usage(self) -> Usage:
        return Usage(prompt_tokens=len(self.prompt_tokens), completion_tokens=self.generated)


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
        self.max_batch_seen = 0
        self.steps = 0
        mx.eval(self.model.parameters())
        self.nbytes = sum(v.nbytes for _, v in _tree_leaves(self.model.parameters()))

    # -- construction helpers ------------------------------------------------------------
    def _apply_dtype(self, dtype: str) -> str:
        """Cast half-precision float weights up where the backend is much faster in float32."""
        quantized = "quantization" in self.config
        target = None
        if dtype == "float32" or (dtype == "auto" and wants_float32()):
            target = mx.float32
        elif dtype in ("float16", "bfloat16"):
            target = getattr(mx, dtype)
        if target is None or quantized:
            return "quantized" if quantized else "native"

        def cast(x: mx.array) -> mx.array:
            return x.astype(target) if x.dtype in _FLOAT_HALF + (mx.float32,) else x

        self.model.apply(cast)
        return str(target).split(".")[-1]

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
    def new_sequence(self, prompt_tokens: list[int], params: SamplingParams) -> Sequence:
        return Sequence(prompt_tokens=prompt_tokens, params=params)

    def add(self, seq: Sequence) -> None:
        p = seq.params
        seq._detok = self.tokenizer.detokenizer
        seq._stops = StopMatcher(p.stop)
        sampler = build_sampler(p, self.vocab_size)
        (uid,) = self._gen.insert(
            [seq.prompt_tokens],
            max_tokens=[p.max_tokens],
            samplers=[sampler],
            logits_processors=[build_logits_processors(p)],
        )
        seq.uid = uid
        self._seqs[uid] = seq

    def cancel(self, seq: Sequence) -> None:
        if seq.uid in self._seqs:
            self._gen.remove([seq.uid])
            del self._seqs[seq.uid]
            seq.finished = True

    def has_work(self) -> bool:
        return bool(self._seqs)

    @property
    def num_running(self) -> int:
        return len(self._gen._generation_batch) if self._gen is not None else 0

    @property
    def num_waiting(self) -> int:
        return len(self._seqs) - self.num_running

    def step(self) -> list[tuple[Sequence, TokenEvent]]:
        """One decode step for the running batch plus one prefill chunk for newcomers."""
        _, responses = self._gen.next()
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
        if to_remove:
            self._gen.remove(to_remove)
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
        event = TokenEvent(text=text, token_ids=[r.token], finish_reason=finish)
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
        for seq in self._seqs.values():
            seq.finished = True
            out.append((seq, TokenEvent(text="", finish_reason="error", error=exc)))
        self._seqs.clear()
        try:
            self._gen.close()
        except Exception:  # noqa: BLE001 - closing a broken generator must not mask exc
            pass
        self._gen = self._new_generator()
        mx.clear_cache()
        return out

    def warmup(self) -> None:
        """One throwaway generation through the batch path, so request one costs what two does."""
        ids = self.encode_prompt("Hello") or [self.eos_token_ids[0] if self.eos_token_ids else 0]
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

    def close(self) -> None:
        """Drop every reference to the weights and caches so their memory really goes back."""
        self._seqs.clear()
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
