"""Vision-language chat over mlx-vlm, batched on the device worker like text generation.

Work splits three ways:

* off the worker (request threads, :meth:`VisionEngine.encode_vision`): the chat template,
  the model's image processor (resize, normalise, patchify) and tokenization, under a lock
  (the fast tokenizer is not safe to share across threads). The result is a
  :class:`VisionPrompt`: the prompt token ids (image placeholders expanded) plus the
  processor's arrays.
* on the worker, as a request joins (:meth:`VisionEngine.step`): the vision encoder, through
  the feature cache (engines/vlm_features.py), and ``get_input_embeddings``; at most one
  request with images that are not cached is encoded per step, so a burst of images cannot
  hold the worker for long.
* on the worker, step by step: mlx-vlm's ``BatchGenerator`` (continuous batching: requests
  join between decode steps, prefill runs in chunks) when the model supports it, checked
  by a batched warm-up; otherwise one request at a time with mlx-vlm's ``generate_step``,
  one token per step. Either way the worker interleaves these steps with other engines.

Waiting requests join in the order of engines/scheduler.py's :class:`FairScheduler`
(priority, then each API key's fair share), as text models' do; a running row is never
preempted here: mlx-vlm's batch cannot hand a row's KV back to resume it later.

mlx-vlm's batch shares one sampler across rows; per-request sampling (temperature, top-k/p,
min-p, seed) is a per-row logits processor here that draws the row's token and hands back a
one-hot row for the batch's argmax (and keeps the raw log-probabilities for ``logprobs``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxd.core.errors import InvalidRequest, MlxdError, ModelLoadError
from mlxd.core.render import check_template_kwargs
from mlxd.core.types import SamplingParams, ThinkSpec
from mlxd.engines.backend import apply_dtype
from mlxd.engines.decode import DecodeEngine, Sequence, StepOutput
from mlxd.engines.options import VisionEngineOptions
from mlxd.engines.sampling import build_logits_processors, build_sampler
from mlxd.engines.scheduler import FairScheduler, queue_by_priority
from mlxd.engines.vlm_features import FeatureCache, FeatureEncoder

log = logging.getLogger(__name__)

_NEG_INF = float("-inf")


class VisionPrompt(list):
    """Prompt token ids (what usage and the context check count) plus the processor's
    arrays (``pixel_values``, ``image_grid_thw``...) and the images' sha256 digests."""

    def __init__(
        self, ids: list[int], inputs: dict | None = None, digests: list[str] | None = None
    ) -> None:
        super().__init__(ids)
        self.inputs = inputs or {}
        self.digests = digests or []


# What mlx-vlm processors return for audio (Gemma 4: log-mel features and their mask).
AUDIO_INPUTS = ("input_features", "input_features_mask")


@dataclass
class LoadedImage:
    """A decoded image (PIL, RGB) and the sha256 of the bytes it came from."""

    image: Any
    digest: str
    param: str = ""


@dataclass
class LoadedAudio:
    """An ``input_audio`` clip as the front end decoded it: mono float32 samples at the
    engine's ``sample_rate`` (numpy), and the message part it came from, for errors."""

    samples: Any
    param: str = ""


class _RowSampler:
    """The last logits processor of a row: draws the row's token with the row's own
    parameters and returns a one-hot row, which the batch's argmax then picks."""

    def __init__(self, params: SamplingParams, vocab_size: int) -> None:
        self.sample = build_sampler(params, vocab_size)
        self.keep = params.logprobs
        self.pending: deque[mx.array] = deque()  # raw log-probs, oldest first

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        logits = logits.astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tok = mx.argmax(lp, axis=-1) if self.sample is None else self.sample(lp)
        if self.keep:
            self.pending.append(lp[0])
        hot = mx.arange(lp.shape[-1])[None, :] == tok.reshape(-1, 1)
        return mx.where(hot, mx.array(0.0, mx.float32), mx.array(_NEG_INF, mx.float32))


def _cache_nbytes(cache: Any) -> int:
    """One layer's cache buffers. mlx-vlm 0.7.10's BatchQuantizedKVCache has no ``nbytes``
    (it raises NotImplementedError): its packed keys and values, scales and biases are
    counted from the arrays themselves."""
    try:
        return int(cache.nbytes)
    except (NotImplementedError, AttributeError):
        arrays = tree_flatten([getattr(cache, "keys", None), getattr(cache, "values", None)])
        return sum(a.nbytes for _, a in arrays if isinstance(a, mx.array))


def _argmax(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


@dataclass(eq=False)
class VisionSequence(Sequence):
    _row: _RowSampler | None = field(default=None, repr=False)
    _steps: Any = field(default=None, repr=False)  # sequential mode: the generate_step iterator


class VisionEngine(DecodeEngine):
    """One loaded vision-language model: its processor, feature cache and batch."""

    kind = "vision"

    def __init__(self, name: str, path: Path, options: VisionEngineOptions | None = None) -> None:
        """Load ``path`` as ``name`` with ``options`` (engines/options.py; None: a bare
        engine's defaults)."""
        super().__init__()
        o = options if options is not None else VisionEngineOptions()
        self.options = o
        self.name = name
        self.path = Path(path)
        adapter_path = o.adapter_path
        try:
            from mlx_vlm.utils import load as vlm_load
        except ImportError as exc:  # the optional [vision] extra is not installed
            raise ModelLoadError(
                f"model '{name}' is a vision model, and serving vision models needs mlx-vlm "
                "(pip install 'mlxd[vision]')"
            ) from exc
        if adapter_path is not None and not adapter_path.expanduser().is_dir():
            raise ModelLoadError(f"adapter for '{name}' not found: {adapter_path}")
        try:
            model, processor = vlm_load(
                str(self.path),
                adapter_path=str(adapter_path.expanduser()) if adapter_path else None,
                trust_remote_code=o.trust_remote_code,
            )
        except Exception as exc:  # ValueError, FileNotFoundError, KeyError...
            raise ModelLoadError(
                f"could not load vision model '{name}' from {path}: {exc}"
            ) from exc
        # transformers warns on every templated request that mlx-vlm passes processor
        # kwargs the legacy way; nothing an operator can act on.
        logging.getLogger("transformers.processing_utils").setLevel(logging.ERROR)
        self.model = model
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.adapter_path = adapter_path
        from mlxd.store.inspect import read_config

        self.config = read_config(self.path)  # config.json, as text engines keep it
        self.model_type = str(getattr(model.config, "model_type", ""))
        self.dtype = self._apply_dtype(o.dtype)
        self.vocab_size = self._vocab_size()
        self.context_length = self._context_length()
        criteria = getattr(self.tokenizer, "stopping_criteria", None)
        self.eos_token_ids = sorted(set(getattr(criteria, "eos_token_ids", None) or []))
        # mlx-vlm's batch cannot rotate a bounded cache: max_kv_size means one at a time.
        self.batching = o.batching and o.max_kv_size is None
        self.features = FeatureEncoder(
            model, FeatureCache(o.feature_cache_entries, o.feature_cache_bytes)
        )
        self._prep_lock = threading.Lock()
        self._pending: list[VisionSequence] = []  # admitted, not yet in the batch
        self.scheduler = FairScheduler()  # who joins the batch next (engines/scheduler.py)
        self._active: dict[int, VisionSequence] = {}  # in the batch (batch mode)
        self._current: VisionSequence | None = None  # running (sequential mode)
        self._gen: Any = None
        self._warming = False
        self.max_batch_seen = 0
        self.steps = 0
        self.cache_hits = 0
        self.cache_misses = 0
        self._bind_stream()
        if self.batching:
            self._gen = self._new_generator()
        mx.eval(self.model.parameters())
        self.nbytes = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))

    # -- construction helpers ------------------------------------------------------------
    def _apply_dtype(self, dtype: str) -> str:
        """As for text models: half-precision weights go float32 where that is much faster."""
        return apply_dtype(self.model, self.config, dtype)

    def _vocab_size(self) -> int:
        text = getattr(self.model.config, "text_config", None)
        v = (
            getattr(text, "vocab_size", None)
            or (self.config.get("text_config") or {}).get("vocab_size")
            or self.config.get("vocab_size")
        )
        if isinstance(v, int) and v > 0:
            return v
        return len(self.tokenizer)

    def _context_length(self) -> int:
        from mlxd.store.inspect import context_length

        n = context_length(self.config)
        if n:
            return n
        v = getattr(self.tokenizer, "model_max_length", None)
        return v if isinstance(v, int) and 0 < v < 10_000_000 else 4096

    def _bind_stream(self) -> None:
        """Run mlx-vlm's single-sequence path on this (the worker) thread's stream.

        mlx-vlm creates its ``generation_stream`` on whichever thread imports it first; MLX
        streams belong to a thread, and the worker need not be the thread that imported it.
        """
        from mlx_vlm.generate import ar

        self._stream = mx.default_stream(mx.default_device())
        ar.generation_stream = self._stream

    def _new_generator(self) -> Any:
        from mlx_vlm.generate import BatchGenerator

        o = self.options
        return BatchGenerator(
            self.model.language_model,
            self.processor,
            sampler=_argmax,
            completion_batch_size=o.max_num_seqs,
            prefill_batch_size=min(o.prefill_batch_size, o.max_num_seqs),
            prefill_step_size=o.prefill_step_size,
            kv_bits=o.kv_bits,
            kv_group_size=o.kv_group_size,
            kv_quant_scheme=o.kv_quant_scheme or "uniform",
            # mlx-vlm's default (5000) makes a batch whose prompts are shorter keep a
            # full-precision cache for turboquant, for good: kv_bits would silently not apply
            quantized_kv_start=0,
            compute_logprobs=False,
            stream=self._stream,
        )

    # -- thread-safe request preparation ---------------------------------------------------
    @property
    def sample_rate(self) -> int:
        """The rate audio parts must be decoded to; 0 when the model takes no audio (no
        audio tower, or a processor without a feature extractor)."""
        fe = getattr(self.processor, "feature_extractor", None)
        if fe is None or getattr(self.model, "audio_tower", None) is None:
            return 0
        return int(getattr(fe, "sampling_rate", 0) or 0)

    def encode_vision(
        self,
        *,
        messages: list[dict] | None = None,
        prompt: str | None = None,
        prompt_tokens: list[int] | None = None,
        images: list[LoadedImage] | None = None,
        template_kwargs: dict | None = None,
        audio: list[LoadedAudio] | None = None,
    ) -> VisionPrompt:
        """Template, image-process and tokenize one request (any thread but the worker's)."""
        images = images or []
        audio = audio or []
        if audio and not self.sample_rate:
            raise InvalidRequest(
                f"model '{self.name}' does not accept audio (it has no audio encoder)",
                param=audio[0].param,
            )
        if len(audio) > 1 and not getattr(self.processor, "supports_multiple_audio", False):
            raise InvalidRequest(
                f"model '{self.name}' takes one audio clip per request", param=audio[1].param
            )
        if prompt_tokens is not None:
            if images or audio:
                raise InvalidRequest(
                    "a token-id prompt cannot carry images or audio", param="prompt"
                )
            bad = [t for t in prompt_tokens if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequest(f"token ids out of range: {bad[:5]}", param="prompt")
            return VisionPrompt(list(prompt_tokens))
        with self._prep_lock:
            if messages is not None:
                text = self._template(messages, len(images), len(audio), template_kwargs or {})
            else:
                text = prompt or ""
            inputs = self._process(text, images, audio)
        ids_arr = inputs.pop("input_ids")
        ids = ids_arr.reshape(-1).tolist() if hasattr(ids_arr, "reshape") else list(ids_arr[0])
        if not ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        return VisionPrompt(ids, inputs, [im.digest for im in images])

    def _template(
        self, messages: list[dict], n_images: int, n_audio: int, template_kwargs: dict
    ) -> str:
        from mlx_vlm.prompt_utils import apply_chat_template

        check_template_kwargs(template_kwargs)  # variables only (core/render.py)
        try:
            out = apply_chat_template(
                self.processor,
                self.model.config,
                messages,
                num_images=n_images,
                num_audios=n_audio,
                **template_kwargs,
            )
        except Exception as exc:  # jinja2 TemplateError, KeyError on odd messages...
            raise InvalidRequest(f"chat template failed: {exc}", param="messages") from exc
        if not isinstance(out, str):  # some families return the last message (PaliGemma)
            content = out.get("content") if isinstance(out, dict) else out
            out = content if isinstance(content, str) else str(content)
        return out

    def _process(self, text: str, images: list[LoadedImage], audio: list[LoadedAudio]) -> dict:
        from mlx_vlm.utils import prepare_inputs

        chat_template = getattr(self.processor, "chat_template", None)
        add_special = (
            (chat_template is None)
            if self.model_type in ("gemma3", "gemma3n", "gemma4", "gemma4_unified")
            else True
        )
        try:
            return dict(
                prepare_inputs(
                    self.processor,
                    images=[im.image for im in images] or None,
                    audio=[a.samples for a in audio] or None,
                    prompts=text,
                    image_token_index=getattr(self.model.config, "image_token_index", None),
                    add_special_tokens=add_special,
                )
            )
        except Exception as exc:  # noqa: BLE001 - the processor rejected these inputs
            media = [*images, *audio]
            where = media[0].param if len(media) == 1 else "messages"
            raise InvalidRequest(
                f"the model's processor could not prepare the input: {exc}", param=where
            ) from exc

    # text-model compatible helpers (token counting, /v1/tokenize)
    def encode_messages(self, messages: list[dict], **template_kwargs: Any) -> list[int]:
        return list(self.encode_vision(messages=messages, template_kwargs=template_kwargs))

    def encode_prompt(self, prompt: str) -> list[int]:
        return list(self.encode_vision(prompt=prompt))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    # -- worker-thread API ---------------------------------------------------------------
    def new_sequence(
        self,
        prompt_tokens: list[int],
        params: SamplingParams,
        *,
        grammar: Any = None,
        arm_after: tuple[int, ...] | None = None,
        think: ThinkSpec | None = None,  # vision prompts carry no reasoning plan
    ) -> VisionSequence:
        if not isinstance(prompt_tokens, VisionPrompt):
            prompt_tokens = VisionPrompt(list(prompt_tokens))
        return VisionSequence(prompt_tokens=prompt_tokens, params=params)

    def add(self, seq: VisionSequence) -> None:
        seq._row = _RowSampler(seq.params, self.vocab_size)
        seq.t_added = time.monotonic()
        self.scheduler.arrive(seq)
        self._pending.append(seq)

    def cancel(self, seq: VisionSequence) -> None:
        seq.finished = True
        if any(s is seq for s in self._pending):
            self._pending = [s for s in self._pending if s is not seq]
        elif self._current is seq:
            self._end_current()
        elif self._active.pop(seq.uid, None) is not None and self._gen is not None:
            self._gen.remove(seq.uid)

    def has_work(self) -> bool:
        return bool(self._pending or self._active or self._current is not None)

    @property
    def num_running(self) -> int:
        return len(self._active) + (self._current is not None)

    @property
    def num_waiting(self) -> int:
        return len(self._pending)

    def memory_bytes(self) -> dict[str, int]:
        """Memory beyond the weights that this engine holds: cached image features and the
        batch's KV cache (what kv_bits / kv_quant_scheme shrink). Read from any thread; a
        racing step can make one reading stale, never wrong for long. The sequential mode's
        cache lives inside mlx-vlm's generate_step and is not counted."""
        return {"image_features": self.features.cache.nbytes, "kv_cache": self._kv_nbytes()}

    def _kv_nbytes(self) -> int:
        gen = self._gen
        if gen is None:
            return 0
        total = 0
        try:
            for batch in (gen._generation_batch, gen._prompt_batch):
                for c in getattr(batch, "prompt_cache", None) or []:
                    total += _cache_nbytes(c)
        except Exception:  # noqa: BLE001 - the batch changed under the reading: next time
            return 0
        return total

    def shrink(self) -> int:
        freed = self.features.cache.nbytes
        self.features.cache.clear()
        return freed

    def stats(self) -> dict[str, Any]:
        return {
            "vision_feature_cache": self.feature_cache_stats(),
            "queue": {"by_priority": queue_by_priority(self._pending), "preemptions": 0},
        }

    def feature_cache_stats(self) -> dict[str, Any]:
        """For /health: the image-feature cache and how often the vision encoder ran."""
        cache = self.features.cache
        return {
            "mode": self.features.mode if cache.enabled else None,
            "entries": len(cache),
            "bytes": cache.nbytes,
            "hits": self.cache_hits,
            "misses": self.cache_misses,
            "encoder_runs": self.features.encoder_runs,
            "batching": self.batching,
        }

    def step(self) -> list[tuple[VisionSequence, StepOutput]]:
        out: list[tuple[VisionSequence, StepOutput]] = []
        self.steps += 1
        if self.batching:
            self._admit(out)
            if self._active:
                _, responses = self._gen.next()
                self.max_batch_seen = max(self.max_batch_seen, len(responses))
                self._on_responses(responses, out)
        else:
            self._step_sequential(out)
        return out

    # batch mode ------------------------------------------------------------------------
    def _admit(self, out: list) -> None:
        """Encode waiting requests into the batch in the scheduler's order: all whose
        images are cached (or that have none), and at most one whose images need the vision
        encoder; the first that would be a second one waits, and those behind it too."""
        room = self.options.max_num_seqs - len(self._active)
        encoded_new = False
        for seq in self.scheduler.pick(self._pending, room, self._active.values()):
            digests = seq.prompt_tokens.digests
            needs_encoder = bool(digests) and self.features.cached_count(digests) < len(digests)
            if needs_encoder and encoded_new:
                break
            self._pending = [s for s in self._pending if s is not seq]
            try:
                ids, kwargs = self._embed(seq)
                (uid,) = self._gen.insert(
                    [ids],
                    max_tokens=[seq.params.max_tokens],
                    prompt_kwargs=[kwargs],
                    logits_processors=[self._processors(seq)],
                )
            except Exception as exc:  # noqa: BLE001 - this request fails, the batch lives
                out.append((seq, self._error(exc)))
                continue
            seq.uid = uid
            seq.t_scheduled = time.monotonic()
            self.scheduler.charge(seq.tenant, len(seq.prompt_tokens), seq.t_scheduled)
            self._active[uid] = seq
            encoded_new = encoded_new or needs_encoder

    def _embed(self, seq: VisionSequence) -> tuple[list[int], dict]:
        """Vision encoder (through the cache) and input embeddings for one request."""
        prompt = seq.prompt_tokens
        inputs = dict(prompt.inputs)
        input_ids = mx.array([list(prompt)])
        pixel_values = inputs.pop("pixel_values", None)
        mask = inputs.pop("attention_mask", None)
        data = {k: v for k, v in inputs.items() if v is not None}
        feats = self._features(prompt, pixel_values)
        if feats is not None:
            data["cached_image_features"] = feats
        emb = self.model.get_input_embeddings(input_ids, pixel_values, mask=mask, **data)
        data.pop("cached_image_features", None)
        # The audio is in the embeddings now; its features (one length per clip) would
        # only stop rows of different lengths from sharing a batch.
        for key in AUDIO_INPUTS:
            data.pop(key, None)
        kwargs = {**data, **{k: v for k, v in emb.to_dict().items() if v is not None}}
        mx.eval([v for v in kwargs.values() if isinstance(v, mx.array)])
        prompt.inputs = {}  # the pixels are in the embeddings now
        return list(prompt), kwargs

    def _features(self, prompt: VisionPrompt, pixel_values: Any) -> Any:
        inputs = {**prompt.inputs, "pixel_values": pixel_values}
        feats, hits, misses = self.features.features(inputs, prompt.digests)
        if not self._warming and (hits or misses):
            from mlxd.observability import metrics

            self.cache_hits += hits
            self.cache_misses += misses
            if hits:
                metrics.vision_feature_cache_hits.labels(self.name).inc(hits)
            if misses:
                metrics.vision_feature_cache_misses.labels(self.name).inc(misses)
            metrics.vision_feature_cache_bytes.labels(self.name).set(self.features.cache.nbytes)
        return feats

    def _processors(self, seq: VisionSequence) -> list:
        return [*build_logits_processors(seq.params), seq._row]

    def _on_responses(self, responses: list, out: list) -> None:
        for r in responses:
            seq = self._active.get(r.uid)
            if seq is None:
                continue
            event = self._on_token(seq, r.token, r.finish_reason)
            self.scheduler.charge(seq.tenant, 1)
            out.append((seq, event))
            if event.finish_reason is not None:
                del self._active[r.uid]
                seq.finished = True
                if r.finish_reason is None:  # a stop string: the batch still holds it
                    self._gen.remove(r.uid)

    # sequential mode -------------------------------------------------------------------
    def _step_sequential(self, out: list) -> None:
        if self._current is None:
            if not self._pending:
                return
            (nxt,) = self.scheduler.pick(self._pending, 1)
            self._pending = [s for s in self._pending if s is not nxt]
            self._current = nxt
            nxt.t_scheduled = time.monotonic()
            self.scheduler.charge(nxt.tenant, len(nxt.prompt_tokens), nxt.t_scheduled)
            self.max_batch_seen = max(self.max_batch_seen, 1)
        seq = self._current
        try:
            if seq._steps is None:
                seq._steps = self._start_sequential(seq)
            token, _ = next(seq._steps)
        except StopIteration:
            token = None
        except Exception as exc:  # noqa: BLE001 - this request fails, the next one runs
            self._end_current()
            out.append((seq, self._error(exc)))
            return
        if token is None:  # the iterator ran out: max_tokens reached
            event = self._on_token(seq, None, "length")
        else:
            token = int(token)
            finish = (
                "stop"
                if token in self.eos_token_ids
                else ("length" if seq.generated + 1 >= seq.params.max_tokens else None)
            )
            event = self._on_token(seq, token, finish)
        self.scheduler.charge(seq.tenant, 1)
        out.append((seq, event))
        if event.finish_reason is not None:
            seq.finished = True
            self._end_current()

    def _start_sequential(self, seq: VisionSequence) -> Any:
        from mlx_vlm.generate import generate_step

        prompt = seq.prompt_tokens
        inputs = dict(prompt.inputs)
        pixel_values = inputs.pop("pixel_values", None)
        mask = inputs.pop("attention_mask", None)
        data = {k: v for k, v in inputs.items() if v is not None}
        feats = self._features(prompt, pixel_values)
        if feats is not None:
            data["cached_image_features"] = feats
        o = self.options
        prompt.inputs = {}
        return generate_step(
            mx.array([list(prompt)]),
            self.model,
            pixel_values,
            mask,
            max_tokens=seq.params.max_tokens,
            sampler=_argmax,
            logits_processors=self._processors(seq),
            prefill_step_size=o.prefill_step_size,
            kv_bits=o.kv_bits,
            kv_group_size=o.kv_group_size,
            kv_quant_scheme=o.kv_quant_scheme or "uniform",
            quantized_kv_start=0,  # as the batch (see _new_generator)
            max_kv_size=o.max_kv_size,
            **data,
        )

    def _end_current(self) -> None:
        seq, self._current = self._current, None
        if seq is not None and seq._steps is not None:
            seq._steps.close()
            seq._steps = None

    # shared ----------------------------------------------------------------------------
    def _on_token(self, seq: VisionSequence, token: int | None, finish: str | None) -> StepOutput:
        raw_lp = seq._row.pending.popleft() if (seq._row and seq._row.pending) else None
        return self._emit(seq, token, finish, raw_lp)

    @staticmethod
    def _error(exc: Exception) -> StepOutput:
        """The core turns it into the request's error (500, or 503 out of memory)."""
        return StepOutput(None, "error", error=exc)

    def _sequences(self) -> list[Sequence]:
        seqs: list[Sequence] = [*self._pending, *self._active.values()]
        if self._current is not None:
            seqs.append(self._current)
        return seqs

    def _reset(self) -> None:
        self._pending.clear()
        self._active.clear()
        if self._current is not None:
            try:
                self._end_current()
            except Exception:  # noqa: BLE001 - closing a broken iterator must not mask exc
                self._current = None
        if self._gen is not None:
            try:
                self._gen.close()
            except Exception:  # noqa: BLE001
                pass
            self._gen = self._new_generator()

    # -- warm-up and capability check ------------------------------------------------------
    def warmup(self) -> None:
        """Two throwaway generations together (one with an image, one without) through the
        batch; a model mlx-vlm cannot batch falls back to one request at a time here."""
        self._warming = True
        try:
            try:
                self._warm_once()
            except Exception as exc:  # noqa: BLE001 - decide the mode, then warm again
                if not self.batching:
                    raise
                log.warning(
                    "vision model %s cannot be batched by mlx-vlm (%s: %s); serving "
                    "it one request at a time",
                    self.name,
                    type(exc).__name__,
                    exc,
                )
                self.fail_all(exc)
                if self._gen is not None:
                    self._gen.close()
                self._gen = None
                self.batching = False
                self._warm_once()
        except MlxdError:
            raise
        except Exception as exc:
            raise ModelLoadError(
                f"vision model '{self.name}' failed its warm-up generation: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        finally:
            self._warming = False
            self.scheduler = FairScheduler()  # the warm-up's tokens are no one's service
            self.features.cache.clear()
            self.features.encoder_runs = 0
            self.max_batch_seen = 0
            self.steps = 0

    def _warm_once(self) -> None:
        from PIL import Image

        image = LoadedImage(Image.new("RGB", (56, 56), (127, 127, 127)), "warmup")
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
        prompts = [
            self.encode_vision(messages=msgs, images=[image]),
            self.encode_vision(messages=[{"role": "user", "content": "Hi"}]),
        ]
        seqs = [
            self.new_sequence(p, SamplingParams(max_tokens=2, temperature=t))
            for p, t in zip(prompts, (0.0, 1.0), strict=True)
        ]
        for seq in seqs:
            seq.handle = None
            self.add(seq)
        errors = []
        for _ in range(10_000):
            if not self.has_work():
                break
            for _seq, ev in self.step():
                if ev.error is not None:
                    errors.append(ev.error)
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Drop every reference to the weights, caches and features."""
        self._pending.clear()
        self._active.clear()
        self._current = None
        self.features.cache.clear()
        if self._gen is not None:
            self._gen.close()
        self._gen = None
        self.model = None
        try:
            from mlxd.observability import metrics

            metrics.vision_feature_cache_bytes.remove(self.name)
        except KeyError:
            pass
        mx.clear_cache()
