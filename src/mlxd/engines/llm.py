"""Text generation over mlx-lm with continuous batching (the engine core's text adapter).

Everything that touches MLX here runs on the device worker thread. The engine emits token
ids (engines/decode.py); templating, tokenizing, detokenizing, stop strings and output
parsing belong to the front ends (text/processor.py, frontend/generation.py).

Per sequence, on top of mlx-lm's batch: a sampler and logits processors (engines/sampling)
when the request asks for more than the batch's shared sampler, a grammar that masks the
logits every step (text/structured), and the prefix cache (engines/prefix_cache): a new
sequence starts from the KV cache of the longest prefix an earlier one left behind. Its
disk tier (engines/prefix_disk) keeps long prefixes across restarts: a sequence whose
prefix is on disk waits outside the batch while the reader thread loads it, then starts as
a memory-tier hit.

With ``engine.speculative`` on (``auto``: prompt lookup where the model can roll its KV
cache back), the batch is engines/spec_batch.py's, which can verify drafts (prompt lookup
or a draft model, engines/speculative.py) in one forward pass, in the steps where that
measured faster than plain decoding.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.utils import load as mlx_lm_load

from mlxd.core.errors import ModelLoadError
from mlxd.core.types import SamplingParams
from mlxd.engines import tensor_parallel
from mlxd.engines.backend import apply_dtype
from mlxd.engines.bounded_kv import BoundedBatchGenerator, can_bound
from mlxd.engines.decode import DecodeEngine, GuardedProcessors, Sequence, StepOutput
from mlxd.engines.grammar_mask import GrammarProcessor
from mlxd.engines.kv_quant import ROTATION, KVQuant
from mlxd.engines.lora import RowAdapters, files_stamp, read_adapter
from mlxd.engines.mixed_step import supports_mixed_steps
from mlxd.engines.options import TextEngineOptions
from mlxd.engines.prefix_cache import PrefixCache
from mlxd.engines.prefix_disk import DiskPrefixCache, model_fingerprint
from mlxd.engines.prompt_end import supports_prompt_end
from mlxd.engines.sampling import build_logits_processors, build_sampler, sampling_probs
from mlxd.engines.scheduler import FairScheduler, queue_by_priority
from mlxd.engines.serving_batch import ServingBatchGenerator, step_budget
from mlxd.engines.spec_batch import SpeculativeBatchGenerator, can_speculate
from mlxd.engines.speculative import DraftModel, Speculator
from mlxd.engines.step_pace import StepPace
from mlxd.engines.think_budget import ThinkBudgetProcessor
from mlxd.observability import metrics
from mlxd.text.processor import TextProcessor

log = logging.getLogger(__name__)

# With nothing running (on a GPU), newcomers are held while a burst still arrives: until
# none came for this long (see LLMEngine._admit).
BURST_GAP_S = 0.003


class LLMEngine(DecodeEngine):
    """One loaded chat/text model and its continuous batch."""

    kind = "chat"

    def __init__(self, name: str, path: Path, options: TextEngineOptions | None = None) -> None:
        """Load ``path`` as ``name`` with ``options`` (engines/options.py; None: a bare
        engine's defaults)."""
        super().__init__()
        o = options if options is not None else TextEngineOptions()
        self.name = name
        self.path = Path(path)
        adapter_path = o.adapter_path
        if adapter_path is not None and not adapter_path.expanduser().is_dir():
            raise ModelLoadError(f"adapter for '{name}' not found: {adapter_path}")
        sharded = tensor_parallel.active()
        self.tp_id = 0
        if sharded:
            # every rank loads its shard of the same model with the same options; the
            # prefix cache stays off (engines/tensor_parallel.py says why)
            o = replace(o, prefix_cache_bytes=0)
            self.tp_id = tensor_parallel.new_engine_id()
            tensor_parallel.publish(("load", self.tp_id, name, str(self.path), o.for_followers()))
        self.options = o
        trust_remote_code = o.trust_remote_code
        # a load that fails here after the followers were told: they drop their shard
        with tensor_parallel.loading(self.tp_id):
            try:
                # trust_remote_code: models.trust_remote_code, off unless the operator says so
                model, tokenizer, config = mlx_lm_load(
                    str(self.path),
                    return_config=True,
                    trust_remote_code=trust_remote_code,
                    tokenizer_config={"trust_remote_code": trust_remote_code},
                    adapter_path=str(adapter_path.expanduser()) if adapter_path else None,
                    lazy=sharded,
                )
            except Exception as exc:  # noqa: BLE001 - ValueError, FileNotFoundError, KeyError...
                raise ModelLoadError(f"could not load model '{name}' from {path}: {exc}") from exc
            if sharded:
                tensor_parallel.shard(model, name, config)
            self.model = model
            self.tokenizer = tokenizer
            self.config = config
            self.adapter_path = adapter_path
            self.dtype = apply_dtype(self.model, self.config, o.dtype)
            self.vocab_size = int(config.get("vocab_size") or len(tokenizer))
            self.context_length = _context_length(config, tokenizer)
            self.eos_token_ids = sorted(tokenizer.eos_token_ids)
            self.text = TextProcessor(name, tokenizer, self.vocab_size, self.eos_token_ids)
            # tokens per step, decode rows first (engines/serving_batch.py)
            self._step_tokens = step_budget(o.max_step_tokens, mx.default_device() != mx.cpu)
            # 'auto' on the CPU: from measured step costs (engines/step_pace.py); a rank
            # group's followers replay the leader's steps, which must not depend on timing
            self._paced = (
                o.max_step_tokens == "auto" and mx.default_device() == mx.cpu and not sharded
            )
            if o.max_kv_size is not None and not can_bound(self.model):
                raise ModelLoadError(
                    f"max_kv_size is set for '{name}', but none of its layers "
                    "keeps a plain KV cache that a bound could rotate"
                )
            self.kv_quant = self._kv_quant(name, o)
            # None: on a GPU only (see _admit, and engines/serving_batch.py for leaves)
            on_gpu = mx.default_device() != mx.cpu
            self._clean_groups = (
                on_gpu if o.clean_prefill_groups is None else o.clean_prefill_groups
            )
            self._defer_leaves = on_gpu if o.defer_leaves is None else o.defer_leaves
            self._gen: Any = None  # built by bind(), on the device thread
            self._seqs: dict[int, Sequence] = {}
            self._pending: list[Sequence] = []
            self.scheduler = FairScheduler()  # who gets a free slot (engines/scheduler.py)
            self._step_ema = 0.005  # seconds per decode step, for admission (see _admit)
            self.prefix_cache = PrefixCache(
                o.prefix_cache_bytes, o.prefix_cache_min_tokens, model=name
            )
            self.disk: DiskPrefixCache | None = None
            self._disk_writes_all = o.prefix_cache_disk_writes == "all"
            if o.prefix_cache_bytes > 0 and o.prefix_cache_disk_bytes > 0 and o.prefix_cache_dir:
                self.disk = self._open_disk_tier(
                    o.prefix_cache_dir, o.prefix_cache_disk_bytes, o.prefix_cache_disk_min_tokens
                )
            self._loading: list[tuple[Sequence, Future]] = []  # waiting for a disk-tier read
            # Reads not yet taken into the memory tier, by entry: a newcomer arriving after a
            # read finished but before this thread inserted its prefix shares that read
            # instead of starting a second one of the same file.
            self._reads: dict[str, Future] = {}
            self._warm_phases: Iterator[list[Sequence]] | None = None
            self._warm_live: list[Sequence] = []
            self.speculator: Speculator | None = None
            self.adapters: RowAdapters | None = None  # LoRA adapters per request
            self.speculative_off_reason: str | None = None
            if o.speculative != "off" and sharded:
                # the followers replay plain batch steps only (engines/tensor_parallel.py)
                self.speculative_off_reason = (
                    f"{tensor_parallel.mode()} parallel: ranks replay plain steps only"
                )
                self._log_off(name)
            elif o.speculative != "off":
                mode = "prompt-lookup" if o.speculative == "auto" else o.speculative
                self.speculator = self._speculator(
                    mode,
                    o.draft_path,
                    o.dtype,
                    trust_remote_code,
                    Speculator(
                        mode,
                        num_draft=o.num_draft_tokens,
                        max_batch=o.speculative_max_batch,
                        min_acceptance=o.speculative_min_acceptance,
                        policy=o.speculative_policy,
                    ),
                )
            self._spec_reported = (0, 0, 0, 0)
            self._spec_plain_reported = 0
            mx.eval(self.model.parameters())
            # a first token from the prefill pass (engines/prompt_end.py); rank groups keep
            # mlx-lm's pass (their followers replay the same steps, so all ranks must agree)
            self._prompt_end = not sharded and supports_prompt_end(self.model)
            # decode rows and prefill chunks in one pass (engines/mixed_step.py)
            self._mixed = o.mixed_steps and self._prompt_end and supports_mixed_steps(self.model)
            self.nbytes = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))
            if self.speculator is not None and self.speculator.drafter is not None:
                draft = self.speculator.drafter.model
                mx.eval(draft.parameters())
                self.nbytes += sum(v.nbytes for _, v in tree_flatten(draft.parameters()))

    def _speculator(
        self,
        mode: str,
        draft_path: str | Path | None,
        dtype: str,
        trust_remote_code: bool,
        spec: Speculator,
    ) -> Speculator | None:
        """The speculation policy, or None (with the reason kept for /health) when this
        model's KV cache cannot be rolled back per row. A draft model that does not share
        this model's tokenizer is a load error: its drafts would be other tokens."""
        if self.options.max_kv_size is not None:
            self.speculative_off_reason = "max_kv_size: a rotating cache cannot roll back"
        elif not can_speculate(self.model):
            self.speculative_off_reason = (
                "the model has layers without a plain KV cache (sliding windows or recurrent state)"
            )
        if self.speculative_off_reason is not None:
            self._log_off(self.name)
            return None
        if mode == "draft":
            if draft_path is None:
                raise ModelLoadError(f"speculative 'draft' for '{self.name}' needs a draft model")
            spec.drafter = DraftModel(
                self._load_draft(Path(draft_path), dtype, trust_remote_code),
                self.vocab_size,
                self.options.prefill_step_size,
                # the catch-up lengths the warm-up runs (DraftModel.warm)
                max_catch_up=spec.num_draft + 1 if compiles_per_shape() else None,
            )
        return spec

    def _log_off(self, name: str) -> None:
        """Speculation asked for by name but off: a warning; under 'auto', where being off
        for such a model is the setting's meaning, a note."""
        level = logging.INFO if self.options.speculative == "auto" else logging.WARNING
        log.log(
            level, "speculative decoding is off for '%s': %s", name, self.speculative_off_reason
        )

    def _load_draft(self, path: Path, dtype: str, trust_remote_code: bool) -> Any:
        try:
            model, tokenizer, config = mlx_lm_load(
                str(path),
                return_config=True,
                trust_remote_code=trust_remote_code,
                tokenizer_config={"trust_remote_code": trust_remote_code},
            )
        except Exception as exc:  # noqa: BLE001 - as for the model itself
            raise ModelLoadError(f"could not load draft model from {path}: {exc}") from exc
        if tokenizer.get_vocab() != self.tokenizer.get_vocab():
            raise ModelLoadError(
                f"draft model {path.name} does not share the tokenizer of '{self.name}' "
                "(their vocabularies differ), so its drafts would be other tokens: pick a "
                "draft model of the same family"
            )
        ours, theirs = _special_tokens(self.tokenizer), _special_tokens(tokenizer)
        if ours != theirs:
            i = min(set(ours.items()) ^ set(theirs.items()))[0]
            raise ModelLoadError(
                f"draft model {path.name} does not share the tokenizer of '{self.name}' "
                f"(their special tokens differ, first at id {i}: "
                f"{ours.get(i, 'not special')!r} for '{self.name}', "
                f"{theirs.get(i, 'not special')!r} for the draft), so it was set up for "
                "another format: pick a draft model of the same family"
            )
        if set(tokenizer.eos_token_ids) != set(self.eos_token_ids):
            # Not a refusal: the served model alone decides where a sequence ends (drafts
            # past the draft's own EOS are verified like any other token), and a base model
            # drafting for its instruct sibling differs only here.
            log.warning(
                "draft model %s ends sequences with other tokens (EOS %s) than '%s' "
                "(EOS %s): probably another variant of the family (base or "
                "instruct), whose drafts may agree less; output is unchanged",
                path.name,
                sorted(tokenizer.eos_token_ids),
                self.name,
                self.eos_token_ids,
            )
        if not can_speculate(model):
            raise ModelLoadError(
                f"draft model {path.name} has layers without a plain KV "
                "cache, which drafting cannot roll back"
            )
        apply_dtype(model, config, dtype)
        return model

    def _kv_quant(self, name: str, o: TextEngineOptions) -> KVQuant | None:
        """The KV quantization ``o`` asks for, checked against the model's heads:
        ``mx.quantize`` groups each head's vector by ``kv_group_size``."""
        if o.kv_bits is None:
            return None
        cfg = self.config
        heads = cfg.get("num_attention_heads") or 1
        head_dim = cfg.get("head_dim") or (cfg.get("hidden_size") or 0) // heads
        if not head_dim or head_dim % o.kv_group_size:
            raise ModelLoadError(
                f"kv_bits is set for '{name}', but its attention heads have {head_dim} "
                f"dimensions, which kv_group_size {o.kv_group_size} does not divide; "
                "choose kv_group_size 32, 64 or 128 dividing it, or leave kv_bits unset"
            )
        return KVQuant(o.kv_bits, o.kv_group_size, o.kv_quant_start)

    def _open_disk_tier(
        self, root: Path, max_bytes: int, min_tokens: int
    ) -> DiskPrefixCache | None:
        """The disk tier in this model's fingerprint folder; None (and a warning) when the
        folder cannot be used: the server still serves, from the memory tier alone."""
        import mlx_lm

        extra = {
            "dtype": str(self.dtype),
            "max_kv_size": self.options.max_kv_size,
            **(
                {
                    "kv_bits": self.options.kv_bits,
                    "kv_group_size": self.options.kv_group_size,
                    "kv_rotation": ROTATION,
                }
                if self.options.kv_bits is not None
                else {}
            ),
            "mlx_lm": mlx_lm.__version__,
            "adapter": model_fingerprint(Path(self.adapter_path).expanduser(), {})
            if self.adapter_path
            else None,
        }
        try:
            return DiskPrefixCache(
                root, model_fingerprint(self.path, extra), max_bytes, min_tokens, self.name
            )
        except OSError as exc:
            log.warning("prefix cache on disk is off for %s: %s", self.name, exc)
            return None

    def bind(self) -> None:
        """On the device thread: the batch, on that thread's stream. Everything before it
        (reading and evaluating the weights) may run on a loader thread, so that a load
        does not pause the other models' decoding."""
        if self._gen is None:
            self._gen = self._new_generator()
            if self.tp_id:
                tensor_parallel.check_loaded(self.tp_id, self.name)

    def _new_generator(self) -> Any:
        """The batch; on rank 0 of a rank group, one that its followers replay."""
        gen = self.raw_generator()
        if self.tp_id and tensor_parallel.leads():
            return tensor_parallel.ReplicatedBatch(gen, self.tp_id)
        return gen

    def raw_generator(self) -> ServingBatchGenerator:
        """mlx-lm's batch (as engines/serving_batch.py runs it), built on the worker thread,
        on *that thread's* default stream.

        mlx-lm's module-level ``generation_stream`` is created by whichever thread imports
        mlx_lm first; running the batch on a stream of another thread makes MLX synchronise
        across threads on every step (mlx_lm.server avoids it the same way).
        """
        o = self.options
        common: dict[str, Any] = dict(
            stream=mx.default_stream(mx.default_device()),
            max_tokens=1,
            stop_tokens=[[t] for t in self.eos_token_ids],
            completion_batch_size=o.max_num_seqs,
            prefill_batch_size=min(o.prefill_batch_size, o.max_num_seqs),
            prefill_step_size=o.prefill_step_size,
            prompt_end=self._prompt_end,
            max_step_tokens=self._step_tokens,
            pace=StepPace(self._step_tokens, 2 * o.prefill_step_size, mixed=self._mixed)
            if self._paced
            else None,
            kv_quant=self.kv_quant,
            mixed=self._mixed,
        )
        plain: dict[str, Any] = dict(
            defer_leaves=self._defer_leaves, pipeline=o.pipeline_decode != "off"
        )
        if self.speculator is not None:  # never with max_kv_size (see _speculator)
            return SpeculativeBatchGenerator(self.model, speculator=self.speculator, **common)
        if o.max_kv_size is not None:
            return BoundedBatchGenerator(self.model, max_kv_size=o.max_kv_size, **plain, **common)
        return ServingBatchGenerator(
            self.model, checkpoint_tokens=self._checkpoint_tokens(), **plain, **common
        )

    def _checkpoint_tokens(self) -> int | None:
        """engine.hybrid_checkpoint_tokens for a model with recurrent or sliding-window
        layers and a prefix cache (engines/prefix_cache.py); None: no checkpoints."""
        o = self.options
        plain = all(type(c) is KVCache for c in make_prompt_cache(self.model))
        if o.prefix_cache_bytes <= 0 or plain:
            return None
        return o.hybrid_checkpoint_tokens

    # -- the token side, for the core's own use (warm-up, token counts) ------------------
    def encode_messages(self, messages: list[dict], **template_kwargs: Any) -> list[int]:
        return self.text.encode_messages(messages, **template_kwargs)

    def encode_prompt(self, prompt: str) -> list[int]:
        return self.text.encode_prompt(prompt)

    def decode(self, ids: list[int]) -> str:
        return self.text.decode(ids)

    # -- worker-thread API ---------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a newcomer; :meth:`_admit` hands newcomers to the batch in groups. A
        newcomer whose prefix the disk tier holds (longer than what memory holds) waits for
        its read first."""
        seq.t_added = time.monotonic()
        if seq.adapter is not None:
            self.load_adapter(*seq.adapter, replace=False)
        self.scheduler.arrive(seq)
        disk = self.disk
        if disk is not None and len(seq.prompt_tokens) > disk.min_tokens:
            in_memory = self.prefix_cache.peek(seq.prompt_tokens, seq.cache_salt)
            entry, n = disk.match(seq.prompt_tokens, seq.cache_salt)
            if entry is not None and n > in_memory:
                fut = self._reads.get(entry.key)
                if fut is None:
                    fut = self._reads[entry.key] = disk.load(entry)
                self._loading.append((seq, fut))
                return
            if entry is None and in_memory < disk.min_tokens:
                disk.count_miss()
        self._pending.append(seq)

    def _poll_loads(self) -> None:
        """Newcomers whose disk-tier read finished join the queue; the prefix they read goes
        into the memory tier, where :meth:`_cached_prefix` finds it."""
        if not self._loading:
            return
        waiting, inserted = [], set()
        for seq, fut in self._loading:
            if not fut.done():
                waiting.append((seq, fut))
                continue
            try:
                got = fut.result()
            except Exception:  # noqa: BLE001 - a failed read is a miss, never a failure
                log.exception("prefix cache on disk: read failed")
                got = None
            if got is not None and id(fut) not in inserted:
                tokens, cache, checkpoints = got
                # the entry matched this sequence's salt: the file and the request share it
                self.prefix_cache.insert(
                    tokens.tolist(),
                    cache,
                    reused=True,
                    salt=seq.cache_salt,
                    checkpoints=checkpoints,
                )
                inserted.add(id(fut))
            if self.disk is not None:  # a hit only if the memory tier took it (it fits)
                if (
                    got is not None
                    and self.prefix_cache.peek(seq.prompt_tokens, seq.cache_salt) > 0
                ):
                    self.disk.count_hit()
                else:
                    self.disk.count_miss()
            self._pending.append(seq)
        self._loading = waiting
        self._prune_reads()

    def _prune_reads(self) -> None:
        """Forget the reads no waiting newcomer holds (taken in, or all their readers gone)."""
        live = {id(f) for _, f in self._loading}
        self._reads = {k: f for k, f in self._reads.items() if id(f) in live}

    def _admit_at(self) -> float:
        """When the waiting newcomers go to mlx-lm (monotonic seconds; see :meth:`_admit`)."""
        pending = self._pending
        if len(pending) >= self.options.prefill_batch_size:
            return 0.0
        hold = min(0.025, 2 * self._step_ema)
        # a preempted row queues again with a new t_added: the list is not in t_added order
        first = min(s.t_added for s in pending)
        if self.num_running:
            return first + hold
        if self._clean_groups:
            return min(max(s.t_added for s in pending) + min(BURST_GAP_S, hold), first + hold)
        return 0.0

    def _admit(self) -> list[tuple[Sequence, StepOutput]]:
        """Insert waiting newcomers into the batch, coalescing arrivals into one prefill.

        mlx-lm prefills newcomers in a forward pass of their own that the whole running
        batch waits for. Under load requests trickle in one by one, and prefilling each
        alone stalls every running sequence once per arrival (seen on an H200: half the
        engine's throughput at 64 clients). So while a batch is running, newcomers wait
        until a prefill batch is full or the oldest has waited about two decode steps
        (capped at 25 ms). With nothing running, on a GPU, they wait while a burst is still
        arriving (the last came less than :data:`BURST_GAP_S` ago, the first at most as
        long as above): clients that start together reach the core a few milliseconds
        apart (each request is parsed, templated and tokenized in turn), and admitting the
        first alone made it a one-row prefill group of its own, which every later wave of
        those clients inherited (their rows end together, so they come back together).

        On a GPU, mlx-lm gets newcomers only as clean prefill groups
        (``ServingBatchGenerator.clean_group_room``): never more than its prompt batch takes
        in one step, and none while it holds a group that joins the decode batch at this
        step; the rest wait here, in order. On the CPU, where a step's cost is its
        arithmetic rather than its fixed per-step host work, holding newcomers back cost
        more than the mixed step does (SmolLM2, C=16: 0.91-0.94x the engine alone against
        0.96-1.05x, TTFT 4.1-5.5 s against 3.8-4.6 s), so there mlx-lm groups them itself
        (``clean_prefill_groups``) and an idle batch takes newcomers at once.

        Newcomers go to mlx-lm only while a slot (``max_num_seqs``) is free, so that they
        wait here, where :class:`FairScheduler` orders them (priority, then each key's fair
        share), rather than first come, first served in mlx-lm's queue; a newcomer of a
        strictly better priority than a running row takes that row's slot, and a key with
        no running row takes one from a key over its fair share of the slots
        (:meth:`_preempt`, :meth:`FairScheduler.fair_victims`).

        Each newcomer's state (sampler, processors, cached prefix) is built in its own
        ``try``: a sequence whose state cannot be built fails alone, never the batch.
        """
        failed: list[tuple[Sequence, StepOutput]] = []
        self._poll_loads()
        if not self._pending:
            return failed
        free = self.options.max_num_seqs - len(self._seqs)
        for victim in self.scheduler.victims(
            self._pending, [s for s in self._seqs.values() if _preemptible(s)], free
        ):
            self._preempt(victim, "priority")
            free += 1
        if self.options.fair_preemption:
            running = list(self._seqs.values())
            for victim in self.scheduler.fair_victims(
                self._pending,
                running,
                [s for s in running if _preemptible(s)],
                self.options.max_num_seqs,
                free,
            ):
                self._preempt(victim, "fair")
                free += 1
        room = self._gen.clean_group_room() if self._clean_groups else len(self._pending)
        room = min(room, free)
        if room <= 0 or time.monotonic() < self._admit_at():
            return failed
        batch = self.scheduler.pick(self._pending, room, self._seqs.values())
        chosen = {id(s) for s in batch}
        self._pending = [s for s in self._pending if id(s) not in chosen]
        ready: list[tuple[Sequence, Any, Any, list]] = []
        for seq in batch:
            try:
                sampler = build_sampler(seq.params, self.vocab_size)
                processors = self._processors(seq)
                cache = self._cached_prefix(seq)
            except Exception as exc:  # noqa: BLE001 - this sequence fails, the batch lives
                seq.finished = True
                failed.append((seq, StepOutput(None, "error", error=exc)))
                continue
            ready.append((seq, sampler, cache, processors))
        if not ready:
            return failed
        caches = [c for _, _, c, _ in ready]
        try:
            uids = self._gen.insert(
                [s.prompt_tokens[s.cached_tokens :] for s, _, _, _ in ready],
                max_tokens=[_tokens_left(s) for s, _, _, _ in ready],
                caches=caches if any(c is not None for c in caches) else None,
                all_tokens=[list(s.prompt_tokens[: s.cached_tokens]) for s, _, _, _ in ready],
                samplers=[sm for _, sm, _, _ in ready],
                logits_processors=[p for _, _, _, p in ready],
            )
        except Exception as exc:  # noqa: BLE001 - the newcomers fail, the running batch lives
            for seq, *_ in ready:
                seq.finished = True
                failed.append((seq, StepOutput(None, "error", error=exc)))
            return failed
        now = time.monotonic()
        for (seq, _, _, processors), uid in zip(ready, uids, strict=True):
            seq.uid = uid
            if not seq.t_scheduled:  # a resumed row's queue time is its first wait's
                seq.t_scheduled = now
            self.scheduler.charge(seq.tenant, len(seq.prompt_tokens) - seq.cached_tokens, now)
            self._seqs[uid] = seq
            if seq.adapter is not None and self.adapters is not None:
                self.adapters.admit(uid, seq.adapter[0])
            if self.speculator is not None:
                self._register_speculation(seq, bool(processors))
        return failed

    def _preempt(self, seq: Sequence, reason: str) -> None:
        """Give ``seq``'s slot to a better priority or a starved key (``reason``: priority
        or fair): its KV goes to the prefix cache, and it queues again with its output so
        far appended to its prompt, so that it resumes from the cache where it stopped;
        its client sees one stream, a pause at most."""
        del self._seqs[seq.uid]
        self._forget(seq.uid)
        caches = self._gen.remove([seq.uid], return_prompt_caches=self.prefix_cache.enabled)
        for cache, tokens in (caches or {}).values():
            if cache and tokens is not None:
                # reused: the row comes back for it, also into a full cache
                self.prefix_cache.insert(list(tokens), cache, reused=True, salt=seq.cache_salt)
        if seq.cached_first is None:  # usage reports the client's prompt, not the resumption's
            seq.cached_first = seq.cached_tokens
        seq.prompt_tokens = [*seq.prompt_tokens, *seq.output[seq.folded :]]
        seq.folded = len(seq.output)
        seq.uid = -1
        seq.t_added = time.monotonic()
        self.scheduler.preemptions += 1
        metrics.preempted(self.name, reason)
        self._pending.append(seq)

    def _register_speculation(self, seq: Sequence, has_processors: bool) -> None:
        """Rows with logits processors or a seed decode plainly (speculator.register says
        why); greedy rows verify by argmax, sampled rows by rejection sampling against
        their sampler's own distribution."""
        p = seq.params
        eligible = not has_processors and (p.greedy or p.seed is None)
        dist = None if p.greedy else sampling_probs(p, self.vocab_size)
        assert self.speculator is not None
        self.speculator.register(seq.uid, eligible=eligible, dist=dist)

    def _cached_prefix(self, seq: Sequence) -> list[Any] | None:
        """The prefix cache's KV for the start of ``seq``'s prompt (sets cached_tokens)."""
        cache, seq.cached_tokens = None, 0
        if self.prefix_cache.enabled:
            cache, seq.cached_tokens = self.prefix_cache.lookup(seq.prompt_tokens, seq.cache_salt)
        return cache

    def _processors(self, seq: Sequence) -> list:
        """The row's processors, guarded (a failure ends that row alone); none at all for a
        row that needs none, which keeps the batch on mlx-lm's batched fast path."""
        processors = build_logits_processors(seq.params)
        if seq.grammar is not None:
            # last, so that nothing after it can lift the grammar's mask
            processors.append(GrammarProcessor(seq.grammar, self.eos_token_ids, seq.arm_after))
        if seq.think is not None and seq.think.budget is not None:
            # after the grammar: a reasoning part at its budget closes whatever else allows
            processors.append(ThinkBudgetProcessor(seq.think))
        return [GuardedProcessors(seq, processors, self.eos_token_ids)] if processors else []

    def stats(self) -> dict[str, Any]:
        prefix: dict[str, Any] = self.prefix_cache.stats()
        prefix["disk"] = self.disk.stats() if self.disk is not None else None
        out: dict[str, Any] = {
            "prefix_cache": prefix,
            "queue": {
                "by_priority": queue_by_priority([*self._pending, *(s for s, _ in self._loading)]),
                "preemptions": self.scheduler.preemptions,
            },
        }
        if self.adapters is not None:
            out["lora_adapters"] = [
                {"name": a.name, "path": str(a.path), "rank": a.rank, "bytes": a.nbytes}
                for a in self.adapters.adapters.values()
            ]
        step_stats = getattr(self._gen, "step_stats", None)
        if step_stats is not None:
            out["step_budget"] = step_stats.as_dict()
            pace = getattr(self._gen, "pace", None)
            if pace is not None:
                out["step_budget"].update(pace.as_dict())
        if self.speculator is not None:
            mode = "auto" if self.options.speculative == "auto" else self.speculator.mode
            out["speculative"] = {"mode": mode, **self.speculator.as_dict()}
        elif self.speculative_off_reason is not None:
            out["speculative"] = {"mode": "off", "reason": self.speculative_off_reason}
        return out

    def _forget(self, uid: int) -> None:
        if self.speculator is not None:
            self.speculator.forget(uid)
        if self.adapters is not None:
            self.adapters.release(uid)

    # -- LoRA adapters per request (engines/lora.py) ---------------------------------------
    def load_adapter(self, name: str, path: str, replace: bool = True) -> None:
        """Load adapter ``name`` from ``path`` (kept when already loaded from the same files
        there and ``replace`` is false); a 400 when it is unusable or in use."""
        if self.adapters is None:
            self.adapters = RowAdapters(self.model, self._adapter_busy)
        have = self.adapters.adapters.get(name)
        if have is not None and not replace and have.path == Path(path).expanduser():
            stamp = files_stamp(have.path)
            if stamp is None or stamp == have.stamp or self.adapters.in_use(name):
                return  # the same files (or gone: the arrays loaded still serve)
        self.adapters.load(read_adapter(name, Path(path)))

    def unload_adapter(self, name: str) -> bool:
        """Drop adapter ``name``; False when it was not loaded; a 400 while in use."""
        if self.adapters is None or name not in self.adapters.adapters:
            return False
        self.adapters.unload(name)
        return True

    def _adapter_busy(self, name: str) -> bool:
        return any(
            s.adapter is not None and s.adapter[0] == name and not s.finished
            for s in self._sequences()
        )

    def _report_speculation(self) -> None:
        """Metrics: the speculation counters' growth since the last report."""
        spec = self.speculator
        st = spec.stats if spec is not None else None
        if st is None or self._warm_phases:
            return  # warm-up drafts are reset when it ends
        now = (st.verify_steps, st.draft_tokens, st.accepted_tokens, st.emitted_tokens)
        plain = st.plain_steps - self._spec_plain_reported
        if now[0] == self._spec_reported[0] and (not plain or (plain < 64 and self._seqs)):
            return  # plain steps alone: reported in batches, and when the batch runs dry
        steps, drafted, accepted, emitted = (
            a - b for a, b in zip(now, self._spec_reported, strict=True)
        )
        self._spec_reported, self._spec_plain_reported = now, st.plain_steps
        assert spec is not None
        metrics.spec_decode_events(
            self.name, steps, drafted, accepted, emitted, spec.as_dict(), plain=plain
        )

    def kv_options(self) -> dict[str, Any]:
        """The decode engines' KV options plus what a token's KV takes here (for /health)."""
        out = super().kv_options()
        out["kv_quant_start"] = self.options.kv_quant_start if self.kv_quant else None
        out["kv_bytes_per_token"] = self.kv_bytes_per_token()
        return out

    def kv_bytes_per_token(self) -> int | None:
        """KV bytes a token of a sequence takes over all layers, quantized when it is
        (packed data, a scale and a bias per group); None when the config hides the shape."""
        cfg = self.config
        layers, heads = cfg.get("num_hidden_layers"), cfg.get("num_attention_heads")
        if not isinstance(layers, int) or not isinstance(heads, int) or heads <= 0:
            return None
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or (cfg.get("hidden_size") or 0) // heads
        # the model's float dtype (a quantized model's scales' too) is its activations'
        leaves: list[Any] = [v for _, v in tree_flatten(self.model.parameters())]  # type: ignore[str-unpack]
        element = next((v.dtype.size for v in leaves if mx.issubdtype(v.dtype, mx.floating)), 2)
        if self.kv_quant is not None:
            return self.kv_quant.bytes_per_token(kv_heads, head_dim, layers, element)
        return 2 * kv_heads * head_dim * element * layers

    def memory_bytes(self) -> dict[str, int]:
        """Memory beyond the weights: the batch's KV cache and the prefix cache. Read from
        any thread (a racing step can make one reading slightly stale, never wrong for long)."""
        kv = 0
        try:
            kv = int(self._gen.prompt_cache_nbytes) if self._gen is not None else 0
        except Exception:  # noqa: BLE001 - the batch changed under the reading: next time
            pass
        out = {"kv_cache": kv, "prefix_cache": self.prefix_cache.nbytes}
        if self.adapters is not None:
            out["lora_adapters"] = self.adapters.nbytes
        return out

    def shrink(self) -> int:
        """Give back what can go without failing anyone: the prefix cache (device thread)."""
        freed = self.prefix_cache.nbytes
        self.prefix_cache.clear()
        return freed

    def flush(self, timeout: float | None = None) -> None:
        """Wait for the disk tier's queued writes (any thread; before the process exits)."""
        if self.disk is not None:
            self.disk.flush(timeout)

    def next_deadline(self) -> float | None:
        """When held-back newcomers must be admitted even if no step happens before; while
        a disk-tier read is in flight, soon (the reader cannot wake the worker)."""
        due = [self._admit_at()] if self._pending else []
        if self._loading:
            due.append(time.monotonic() + 0.002)
        return min(due) if due else None

    def cancel(self, seq: Sequence) -> None:
        """Leave the batch now (client gone, or a stop string the front end saw); the KV
        cache goes to the prefix cache, as a finished sequence's does."""
        if seq in self._pending:
            self._pending.remove(seq)
            seq.finished = True
        elif any(s is seq for s, _ in self._loading):
            self._loading = [(s, f) for s, f in self._loading if s is not seq]
            self._prune_reads()
            seq.finished = True
        elif seq.uid in self._seqs:
            del self._seqs[seq.uid]
            seq.finished = True
            self._forget(seq.uid)
            caches = self._gen.remove([seq.uid], return_prompt_caches=self.prefix_cache.enabled)
            for cache, tokens in (caches or {}).values():
                self._keep(seq, tokens, cache)

    def _keep(self, seq: Sequence, tokens: list[int], cache: list[Any]) -> None:
        """A finished sequence's KV: into the memory tier, and to disk when it started from
        a cached prefix (``prefix_cache_disk_writes: reused``). One-off prompts are never
        written: a write reads the arrays on the host, which on CUDA moves each of them
        into managed memory (MLX's allocator), and writing every request cost the decode
        loop on an H200 about a tenth of its throughput at 64 clients, none read back."""
        take = getattr(self._gen, "take_checkpoints", None)
        checkpoints = self.prefix_cache.inherit(
            tokens, take(seq.uid) if take is not None else None, seq.cache_salt
        )
        self.prefix_cache.insert(
            tokens,
            cache,
            reused=seq.cached_tokens > 0,
            salt=seq.cache_salt,
            checkpoints=checkpoints,
        )
        if (
            self.disk is not None
            and self._warm_phases is None
            and (self._disk_writes_all or seq.cached_tokens > 0)
        ):
            self.disk.spill(tokens, cache, seq.cache_salt, checkpoints)

    def has_work(self) -> bool:
        self._poll_loads()
        return bool(self._seqs) or (bool(self._pending) and time.monotonic() >= self._admit_at())

    @property
    def num_running(self) -> int:
        return len(self._gen._generation_batch) if self._gen is not None else 0

    @property
    def num_waiting(self) -> int:
        return len(self._seqs) + len(self._pending) + len(self._loading) - self.num_running

    def step(self) -> list[tuple[Sequence, StepOutput]]:
        """One decode step for the running batch plus one prefill chunk for newcomers."""
        running = bool(self._seqs)
        out = self._step()
        self._warm_step(out)
        if running and not self._seqs and not self._pending:
            # the batch ran dry (and this step's arrays are gone): hand MLX's buffer
            # cache back, so memory at rest is what mlx-lm leaves (engines/serving_batch.py)
            mx.clear_cache()
        return out

    def _step(self) -> list[tuple[Sequence, StepOutput]]:
        out = self._admit()
        if not self._seqs:
            return out
        t0 = time.perf_counter()
        _, responses = self._gen.next()
        if responses:
            self._step_ema = 0.8 * self._step_ema + 0.2 * (time.perf_counter() - t0)
        self.steps += 1
        # a verify step answers a row once per token it emits
        rows = len(responses) if self.speculator is None else len({r.uid for r in responses})
        self.max_batch_seen = max(self.max_batch_seen, rows)
        for r in responses:
            seq = self._seqs.get(r.uid)
            if seq is None:
                continue
            finish = r.finish_reason  # "stop": r.token is an EOS, which is never shown
            if seq.error is not None:  # its processors failed: it alone ends, with the error
                out.append((seq, StepOutput(None, "error", error=seq.error)))
                del self._seqs[r.uid]
                seq.finished = True
                self._forget(r.uid)
                if finish is None:
                    self._gen.remove([r.uid])
                continue
            out.append((seq, self._emit(seq, r.token, finish, r.logprobs)))
            self.scheduler.charge(seq.tenant, 1)
            if finish is not None:
                del self._seqs[r.uid]
                seq.finished = True
                self._forget(r.uid)
                if r.prompt_cache is not None and self.prefix_cache.enabled:
                    self._keep(seq, r.all_tokens, r.prompt_cache)
        if self.speculator is not None:
            self._report_speculation()
        return out

    # -- DecodeEngine hooks ----------------------------------------------------------------
    def _sequences(self) -> list[Sequence]:
        return [*self._seqs.values(), *self._pending, *(s for s, _ in self._loading)]

    def _reset(self) -> None:
        if self.speculator is not None:
            self.speculator.clear()
        self._seqs.clear()
        self._pending.clear()
        self._loading.clear()
        self._reads.clear()
        self.prefix_cache.clear()  # may be what filled the memory
        try:
            if self._gen is not None:
                self._gen.close()
        except Exception:  # noqa: BLE001 - closing a broken generator must not mask the fault
            pass
        self._gen = self._new_generator()

    def warmup(self) -> None:
        """Warm up synchronously (the engine stepped here until done); see
        :meth:`start_warmup`."""
        done = self.start_warmup()
        while not done.done():
            self.step()
        done.result()

    def start_warmup(self) -> Future:
        """Begin throwaway generations through the batch path, so request one costs what two
        does; they run as ordinary work of this engine, step by step between the other
        models' steps (a load never pauses the others for a whole warm-up). The Future
        completes when the last warm-up sequence has finished.

        Through the chat template when there is one (its first rendering compiles the jinja
        template), with a greedy and a sampled row; on a GPU also at the batch shapes a first
        burst meets: a full prefill batch, then decode at each power-of-two batch size (MLX
        compiles kernels per shape on first contact; a first burst of 16 clients saw a 5 s
        TTFT p95 on an H200 without this).
        """
        self._warm_done: Future = Future()
        self._warm_phases = self._warm_batches()
        self._warm_live: list[Sequence] = []
        self._next_warm_phase()
        return self._warm_done

    def _warm_batches(self) -> Iterator[list[Sequence]]:
        ids: list[int] = []
        if getattr(self.tokenizer, "has_chat_template", False):
            try:
                ids = self.encode_messages([{"role": "user", "content": "Hello"}])
            except Exception:  # noqa: BLE001 - an odd template must not stop the load
                ids = []
        ids = (
            ids
            or self.encode_prompt("Hello")
            or [self.eos_token_ids[0] if self.eos_token_ids else 0]
        )
        greedy, sampled = (
            SamplingParams(max_tokens=3, temperature=0.0),
            SamplingParams(max_tokens=3, temperature=1.0),
        )
        yield [self.new_sequence(ids, greedy), self.new_sequence(ids, sampled)]
        yield from self._warm_verify_batches(ids)
        if not compiles_per_shape():
            return  # nothing compiles per shape on the CPU: one pair warms every path
        n = min(self.options.prefill_batch_size, self.options.max_num_seqs)
        if n > 2:
            yield [self.new_sequence(ids, greedy if i % 2 else sampled) for i in range(n)]
        size = 4
        while size <= self.options.max_num_seqs:
            yield [self.new_sequence(ids, greedy) for _ in range(size)]
            size *= 2
        for n in self._warm_prompt_lengths(ids):  # longer prefills, one at a time
            yield [self.new_sequence(_stretch(ids, n), greedy)]

    def _warm_prompt_lengths(self, ids: list[int]) -> list[int]:
        """Prompt lengths a GPU warm-up prefills beyond the short templated one.

        On an H200 a model whose weights are MLX-quantized (the store's native GGUF import)
        took 18 s over its first request of ~150 prompt tokens after a warm-up that had
        prefilled only ~30 (later requests of other lengths: normal), so MLX apparently
        compiles its quantized kernels by ranges of rows rather than per length. So: one
        prefill of 128 tokens and one of a whole chunk; with them that model's first
        request came at once. A quantized *draft* model's slow first request was shapes
        of its own: its drafting loop's and its catch-ups after a pause (``DraftModel``)."""
        step = self.options.prefill_step_size
        room = self.context_length - 4  # the warm-up's few new tokens
        return [n for n in sorted({min(128, step, room), min(step, room)}) if n > len(ids)]

    def _warm_verify_batches(self, ids: list[int]) -> Iterator[list[Sequence]]:
        """With speculation on: verify steps at every draft length and at power-of-two
        batch sizes up to engine.speculative_max_batch (no cap: the batch's), drafts forced
        (Speculator.warm).

        A verify step's shape is (rows, draft length + 1), and the rollback after it
        another per accepted length: on an H200 the first requests with prompt lookup
        decoded at a third of the later ones' rate (0.5x plain decoding instead of 2.5x)
        while MLX compiled those shapes. Cheap on a CPU too, where it also runs the
        speculative path once before the first request."""
        spec = self.speculator
        if spec is None:
            return
        if spec.drafter is not None and compiles_per_shape():
            # the draft model's own shapes: its prompt passes and every catch-up length
            # (forced drafts below never run it)
            for n in [len(ids), *self._warm_prompt_lengths(ids)]:
                spec.drafter.warm(_stretch(ids, n), spec.num_draft)
        params = SamplingParams(max_tokens=3 * spec.num_draft, temperature=0.0)
        spec.warm = True
        size = 1
        # no cap: every batch size may verify; a CPU compiles nothing per shape, so one row
        top = spec.max_batch or (self.options.max_num_seqs if compiles_per_shape() else 1)
        while size <= min(top, self.options.max_num_seqs):
            yield [self.new_sequence(ids, params) for _ in range(size)]
            size *= 2
        spec.warm = False

    def _next_warm_phase(self) -> None:
        batch = next(self._warm_phases, None) if self._warm_phases is not None else None
        if batch is None:
            self._warm_phases = None
            self._warm_live = []
            self.max_batch_seen = 0
            self.steps = 0
            if self.speculator is not None:  # warm-up drafts are nobody's statistics
                self.speculator.warm = False
                self.speculator.reset_measurements()
                self._spec_reported = (0, 0, 0, 0)
                self._spec_plain_reported = 0
            self.prefix_cache.clear()  # no warm-up KV (nor its bytes in the metrics)
            self.prefix_cache = PrefixCache(
                self.prefix_cache.max_bytes, self.prefix_cache.min_hit_tokens, model=self.name
            )
            if not self._warm_done.done():
                self._warm_done.set_result(None)
            return
        self._warm_live = batch
        for seq in batch:
            self.add(seq)
            seq.t_added = 0.0  # admitted at the next step: no coalescing wait

    def _warm_step(self, out: list[tuple[Sequence, StepOutput]]) -> None:
        """After a step: a failed warm-up sequence fails the warm-up; a finished phase
        starts the next."""
        if self._warm_phases is None:
            return
        for seq, ev in out:
            if ev.error is not None and seq in self._warm_live:
                self._warm_phases = None
                if self.speculator is not None:
                    self.speculator.warm = False
                self._warm_live = []
                if not self._warm_done.done():
                    self._warm_done.set_exception(ev.error)
                return
        if all(s.finished for s in self._warm_live):
            self._next_warm_phase()

    def close(self) -> None:
        """Drop every reference to the weights and caches so their memory really goes back."""
        self._seqs.clear()
        self._pending.clear()
        self._loading.clear()
        self._reads.clear()
        self.prefix_cache.clear()
        if self.disk is not None:
            self.disk.close()  # the queued writes are what a restart will find
        if self._gen is not None:
            self._gen.close()
        self._gen = None
        self.model = None
        self.speculator = None  # and with it the draft model
        mx.clear_cache()
        if self.tp_id:
            tensor_parallel.publish(("close", self.tp_id))


def _preemptible(seq: Sequence) -> bool:
    """Whether a running row can stop and resume with the same output: not one with a
    grammar (its matcher's state is not replayed), a reasoning budget (its count would
    restart) nor a seeded sampler (its random stream would restart), nor one that already
    failed."""
    return (
        seq.grammar is None
        and (seq.think is None or seq.think.budget is None)
        and seq.params.seed is None
        and seq.error is None
    )


def _tokens_left(seq: Sequence) -> int | None:
    """The tokens ``seq`` may still generate (a resumed row has generated some)."""
    cap = seq.params.max_tokens
    return cap if cap is None or cap <= 0 else max(cap - seq.folded, 1)


def compiles_per_shape() -> bool:
    """Whether MLX compiles kernels per shape on first contact here (a GPU), which the
    warm-up then runs ahead of the first requests."""
    return mx.default_device() != mx.cpu


def _stretch(ids: list[int], n: int) -> list[int]:
    """``ids`` repeated to ``n`` tokens: a warm-up prompt of a given length."""
    return (ids * (n // max(len(ids), 1) + 1))[:n]


def _special_tokens(tokenizer: Any) -> dict[int, str]:
    """The tokenizer's special added tokens, id -> text: two tokenizers whose vocabularies
    match but whose specials differ were configured apart (another chat format, another
    version), which the draft-model check treats as another tokenizer."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {int(i): t.content for i, t in decoder.items() if getattr(t, "special", False)}


def _context_length(config: dict, tokenizer: Any) -> int:
    for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
        v = config.get(key) or (config.get("text_config") or {}).get(key)
        if isinstance(v, int) and v > 0:
            return v
    v = getattr(tokenizer, "model_max_length", None)
    if isinstance(v, int) and 0 < v < 10_000_000:
        return v
    return 4096
