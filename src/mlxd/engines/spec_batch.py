"""Speculative decoding inside mlx-lm's continuous batch (engine.speculative).

mlx-lm 0.32.2's ``GenerationBatch`` keeps one token per row in flight: sampled, not yet
emitted and not yet in the KV cache. A plain step feeds it, emits it and samples the next.
A verify step here feeds ``[that token, d1..dK]`` per row in one forward pass (rows with
shorter drafts are padded to the batch's K), emits that token plus the accepted drafts,
and keeps the token the verification sampled after them in flight -- so what a step
emits and what the cache holds mean the same as in a plain step, and the batch can go on
with either kind of step next.

Per-row rollback: mlx-lm's ``BatchKVCache`` keeps rows right-aligned on one shared end
index (``left_padding`` marks each row's start). After verification row ``i`` must drop
its ``r_i = K - a_i`` rejected positions. The cache first trims ``min(r)`` from every
row (bookkeeping only), then rolls each row right by what it still has to drop, which
turns the rejected tail into left padding -- the move the cache already makes to
right-align right-padded prompts (``prepare(right_padding=...)`` + ``finalize()``). At
batch size one, or when all rows accepted alike, nothing is copied. Models whose cache is
not all plain KV layers (sliding windows, recurrent state) or with ``max_kv_size`` do not
speculate (see :func:`can_speculate`).

The plain step is mlx-lm's own, untouched. Whether a step may draft at all is the
speculator's call (engines/speculative.py ``CostModel``: speculating steps against plain
ones, by measured wall time per batch size, under ``engine.speculative_max_batch`` if set);
a step that may draft verifies when some row has a draft.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxd.engines.lora import set_rows
from mlxd.engines.serving_batch import ServingBatchGenerator, ServingGenerationBatch
from mlxd.engines.speculative import Speculator, verify_greedy, verify_sampled


def can_speculate(model: Any) -> bool:
    """Whether every layer keeps a plain KV cache, which the batch can trim per row."""
    try:
        return all(type(c) is KVCache for c in make_prompt_cache(model))
    except Exception:  # noqa: BLE001 - an odd model: no speculation, not a failed load
        return False


def rollback_rows(caches: list[Any], drop: list[int]) -> None:
    """Drop the last ``drop[i]`` positions of row ``i`` from every layer's BatchKVCache:
    trim what all rows drop, then roll each row right by the rest, into its left padding
    (see the module docstring)."""
    common = min(drop)
    extra = [d - common for d in drop]
    for c in caches:
        if common:
            c.trim(common)
        if any(extra):
            c.prepare(right_padding=extra)
            c.finalize()


class SpeculativeGenerationBatch(ServingGenerationBatch):
    """The serving decode batch (its KV row pools: engines/kv_rows.py) with a verify step
    beside its plain one. Finished rows leave at once (no ``defer_leaves``): a verify
    step knows no rows that decode unseen."""

    speculator: Speculator | None = None
    fed_tokens = 0  # tokens the last step fed the model, for the serving batch's budget

    def next(self) -> list[GenerationBatch.Response]:
        spec = self.speculator
        self.fed_tokens = len(self.uids)  # a verify step's: its drafts too (step budget)
        if spec is None or not self.uids:
            return super().next()
        n = len(self.uids)
        speculating = spec.speculates(n)
        out = self._speculative_step(spec) if speculating else super().next()
        spec.step_done(n, speculating, len(out))
        return out

    def _speculative_step(self, spec: Speculator) -> list[GenerationBatch.Response]:
        """A step that may draft: a verify step when some row has a draft, else plain."""
        # A draft model's first draft for a row must read the row's whole prompt. Doing
        # that inside the row's first verify step held its first token back by that pass
        # (CPU: TTFT 2.0 -> 4.6 s); instead the row's first token comes from this step
        # without a draft, and the draft's prompt pass is queued behind it.
        fresh = (
            [
                (uid, list(self.tokens[i]))
                for i, uid in enumerate(self.uids)
                if self._num_tokens[i] == 0 and spec.drafts_with_model(uid)
            ]
            if spec.drafter is not None and not spec.warm
            else []
        )
        skip = {uid for uid, _ in fresh}
        wanting = [uid not in skip and spec.wants_draft(uid) for uid in self.uids]
        drafts: list[list[int]] = []
        if any(wanting):
            pending = self._next_tokens.tolist()
            drafts = [
                spec.propose(
                    uid, [*self.tokens[i], pending[i]], self.max_tokens[i] - self._num_tokens[i] - 1
                )
                if want
                else []
                for i, (uid, want) in enumerate(zip(self.uids, wanting, strict=True))
            ]
        if any(drafts):
            out = self._verify(pending, drafts)
        else:
            spec.stats.plain_steps += 1
            out = super().next()
        live = set(self.uids)
        for uid, tokens in fresh:
            if uid in live:
                spec.drafter.prefill(uid, tokens)
        return out

    # -- the verify step -------------------------------------------------------------------
    def _verify(
        self, pending: list[int], drafts: list[list[int]]
    ) -> list[GenerationBatch.Response]:
        spec = self.speculator
        assert spec is not None
        n = len(self.uids)
        k = max(len(d) for d in drafts)
        lens = [len(d) for d in drafts]
        padded = [d + [0] * (k - len(d)) for d in drafts]
        self.fed_tokens = n * (k + 1)
        inputs = mx.array([[p, *d] for p, d in zip(pending, padded, strict=True)], dtype=mx.uint32)
        self._current_tokens = self._next_tokens
        self._current_logprobs = self._next_logprobs

        set_rows(self.model, self.uids)  # each row's LoRA adapter (engines/lora.py)
        logits = self.model(inputs, cache=self.prompt_cache)  # [n, k+1, V]
        token_context = []
        if any(self.logits_processors):
            # rows with processors never draft: only their first position is used
            first = []
            for e in range(n):
                row = logits[e : e + 1, 0]
                processors = self.logits_processors[e] or ()
                if processors:
                    context = self._token_context[e].update_and_fetch(inputs[e : e + 1, 0])
                    token_context.append(context)
                    for proc in processors:
                        row = proc(context, row)
                first.append(row)
            logits = mx.concatenate([mx.concatenate(first, axis=0)[:, None], logits[:, 1:]], axis=1)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)

        accepted: list[Any] = [0] * n
        nxt: list[Any] = [None] * n
        greedy = [i for i in range(n) if lens[i] and spec.rows[self.uids[i]].dist is None]
        sampled = [i for i in range(n) if lens[i] and spec.rows[self.uids[i]].dist is not None]
        for i in range(n):
            if not lens[i]:  # a plain row inside the verify pass: its own sampler
                sampler = (self.samplers[i] if self.samplers else None) or self.fallback_sampler
                nxt[i] = sampler(logprobs[i : i + 1, 0])[0]
        if greedy:
            idx = mx.array(greedy)
            acc, tok = verify_greedy(
                logprobs[idx],
                mx.array([padded[i] for i in greedy]),
                mx.array([lens[i] for i in greedy]),
            )
            for j, i in enumerate(greedy):
                accepted[i], nxt[i] = acc[j], tok[j]
        if sampled:
            p = mx.stack([spec.rows[self.uids[i]].dist(logprobs[i]) for i in sampled])
            acc, tok = verify_sampled(
                p, mx.array([padded[i] for i in sampled]), mx.array([lens[i] for i in sampled])
            )
            for j, i in enumerate(sampled):
                accepted[i], nxt[i] = acc[j], tok[j]
        acc_arr = (
            mx.array([0] * n)
            if not (greedy or sampled)
            else mx.stack([a if isinstance(a, mx.array) else mx.array(a) for a in accepted])
        )
        next_tokens = mx.stack(nxt).astype(mx.uint32)
        mx.eval(acc_arr, next_tokens, self._current_logprobs, token_context)
        acc_list: list[int] = acc_arr.tolist()

        drop = [k - a for a in acc_list]
        if max(drop) != min(drop):  # rows rolled into their left padding: masks again
            self._rows_change()
        rollback_rows(self.prompt_cache, drop)
        self._next_tokens = next_tokens
        self._next_logprobs = [logprobs[i, acc_list[i]] for i in range(n)]
        mx.async_eval(self._next_tokens, self._next_logprobs)

        stats = spec.stats
        stats.verify_steps += 1
        stats.row_steps += n
        stats.max_verify_batch = max(stats.max_verify_batch, n)
        emitted: list[list[int]] = []
        for i, uid in enumerate(self.uids):
            a = acc_list[i]
            toks = [pending[i], *drafts[i][:a]]
            emitted.append(toks)
            self.tokens[i].extend(toks)
            stats.emitted_tokens += len(toks)
            if lens[i]:
                stats.drafts += 1
                stats.draft_tokens += lens[i]
                stats.accepted_tokens += a
                spec.update(uid, lens[i], a)
        return self._respond(emitted, logprobs)

    def _respond(
        self, emitted: list[list[int]], logprobs: mx.array
    ) -> list[GenerationBatch.Response]:
        """One response per emitted token, in order; a row that finishes mid-way (EOS,
        max_tokens) stops there, its cache and tokens cut back to the finishing token."""
        keep, responses = [], []
        for i, toks in enumerate(emitted):
            finish = None
            for j, tok in enumerate(toks):
                lp = self._current_logprobs[i] if j == 0 else logprobs[i, j - 1]
                self._num_tokens[i] += 1
                if self._num_tokens[i] >= self.max_tokens[i]:
                    finish = "length"
                if self._matchers[i].advance(tok):
                    finish = "stop"
                if finish is None:
                    responses.append(self.Response(self.uids[i], tok, lp, None, None, None))
                    continue
                extra = len(toks) - 1 - j
                cache = self.extract_cache(i)
                if extra:
                    for c in cache:
                        c.trim(extra)
                tokens = self.tokens[i][: len(self.tokens[i]) - extra]
                responses.append(self.Response(self.uids[i], tok, lp, finish, cache, tokens))
                break
            if finish is None:
                keep.append(i)
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses


class SpeculativeBatchGenerator(ServingBatchGenerator):
    """The serving batch (engines/serving_batch.py) whose generation batch can verify drafts."""

    def __init__(self, model: Any, *, speculator: Speculator, **kwargs: Any) -> None:
        super().__init__(model, **kwargs)
        batch = SpeculativeGenerationBatch.empty(self.model, self.sampler)
        batch.speculator = speculator
        self._generation_batch = batch
        self.speculator = speculator

    def _next(self) -> tuple[list, list]:
        """The serving step; prefill or rows joining in it make the next decode step's
        wall time not that step's own (CostModel)."""
        prompt_responses, generation_responses = super()._next()
        if prompt_responses:
            self.speculator.cost.interrupt()
        return prompt_responses, generation_responses

    def remove(self, uids: Any, return_prompt_caches: bool = False) -> Any:
        self.speculator.cost.interrupt()  # reshaping the batch between two steps
        return super().remove(uids, return_prompt_caches=return_prompt_caches)
