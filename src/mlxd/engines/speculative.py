"""Speculative decoding's pieces that know nothing of the batch: drafting, the acceptance
rule, and each sequence's adaptive draft length.

Drafts are always deterministic here: prompt-lookup copies the continuation of the last
n-gram's previous occurrence, and a draft model drafts greedily. So the draft distribution
``q`` is one-hot and the standard rejection rule (accept draft token ``d`` with probability
``min(1, p(d)/q(d))``, on rejection sample from ``norm(max(0, p - q))``) becomes: accept
``d`` with probability ``p(d)``, on rejection sample from ``p`` without ``d``. The general
rule (any ``q``) is what :func:`verify_sampled` implements, so it can be checked against
its textbook form; greedy rows need none of it (:func:`verify_greedy`).

The batch side (engines/spec_batch.py) feeds the model ``[pending token, drafts...]`` per
row, calls these to decide, and rolls the KV cache back per row.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

NGRAM_MAX = 4  # longest suffix looked up; longer matches predict better
NGRAM_MIN = 2  # a single repeated token predicts too little to be worth verifying


def ngram_draft(
    tokens: np.ndarray, k: int, max_n: int = NGRAM_MAX, min_n: int = NGRAM_MIN
) -> list[int]:
    """Prompt lookup: the up to ``k`` tokens that followed the most recent earlier
    occurrence of the sequence's last n-gram (longest n first). Empty when nothing matches.

    The most recent occurrence, because text being repeated or edited tends to continue the
    way it did the last time its context appeared.
    """
    n_tok = len(tokens)
    if k <= 0 or n_tok < min_n + 1:
        return []
    for n in range(min(max_n, n_tok - 1), min_n - 1, -1):
        suffix = tokens[n_tok - n :]
        # windows that end before the last token, so each has at least one token after it
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: n_tok - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


def verify_greedy(logits: mx.array, drafts: mx.array, lens: mx.array) -> tuple[mx.array, mx.array]:
    """Greedy verification of ``N`` rows: (accepted counts [N], next token [N]).

    ``logits`` [N, K+1, V] are the target's at the pending token and after each draft token,
    ``drafts`` [N, K] the proposals (padded), ``lens`` [N] how many of them are real. A draft
    token is accepted while it equals the target's argmax; the next token is the target's
    argmax after the last accepted one -- exactly what plain greedy decoding would emit.
    """
    best = mx.argmax(logits, axis=-1)  # [N, K+1]
    k = drafts.shape[1]
    ok = (best[:, :k] == drafts) & (mx.arange(k)[None, :] < lens[:, None])
    accepted = mx.sum(mx.cumprod(ok.astype(mx.int32), axis=1), axis=1)
    nxt = mx.take_along_axis(best, accepted[:, None], axis=1)[:, 0]
    return accepted, nxt


def verify_sampled(
    p: mx.array,
    drafts: mx.array,
    lens: mx.array,
    q: mx.array | None = None,
    key: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Rejection-sampling verification of ``N`` rows: (accepted counts [N], next token [N]).

    ``p`` [N, K+1, V]: the target's sampling distributions (temperature and filters
    applied) at the pending token and after each draft token; ``drafts`` [N, K] (padded),
    ``lens`` [N] real draft lengths; ``q`` [N, K, V] the draft distributions, None for
    deterministic drafts (one-hot). Draft token ``j`` is accepted with probability
    ``min(1, p_j(d_j) / q_j(d_j))`` while all before it were; at the first rejection the next
    token comes from ``norm(max(0, p_j - q_j))``, and when all ``lens`` drafts are accepted
    from ``p_lens``. The emitted tokens are then distributed exactly as plain sampling from
    ``p`` would give (Leviathan et al. 2023, Chen et al. 2023).
    """
    n, k1, vocab = p.shape
    k = k1 - 1
    keys = mx.random.split(key, 2) if key is not None else (None, None)
    if k > 0:
        p_d = mx.take_along_axis(p[:, :k], drafts[..., None], axis=2)[..., 0]
        if q is None:
            q = (mx.arange(vocab)[None, None, :] == drafts[..., None]).astype(p.dtype)
            q_d = mx.ones_like(p_d)
        else:
            q_d = mx.take_along_axis(q, drafts[..., None], axis=2)[..., 0]
        u = mx.random.uniform(shape=(n, k), key=keys[0])
        ok = (u * q_d < p_d) & (mx.arange(k)[None, :] < lens[:, None])
        accepted = mx.sum(mx.cumprod(ok.astype(mx.int32), axis=1), axis=1)
        residual = mx.maximum(p[:, :k] - q, 0.0)
        residual = residual / mx.maximum(mx.sum(residual, axis=-1, keepdims=True), 1e-30)
        # pick, per row, the residual at the first rejection or p after the last draft
        at = accepted[:, None, None]
        from_res = mx.take_along_axis(residual, mx.minimum(at, k - 1), axis=1)[:, 0]
        from_p = mx.take_along_axis(p, at, axis=1)[:, 0]
        dist = mx.where((accepted < lens)[:, None], from_res, from_p)
    else:
        accepted = mx.zeros((n,), dtype=mx.int32)
        dist = p[:, 0]
    nxt = mx.random.categorical(mx.log(dist), key=keys[1])
    return accepted, nxt


@dataclass(slots=True)
class RowState:
    """One sequence's drafting state: how far it drafts now, how well drafts fared lately."""

    eligible: bool  # no per-row processors, no seed: see Speculator.register
    dist: Any = None  # logprobs -> sampling probabilities; None: greedy
    k: int = 4
    rate: float = 1.0  # moving average of accepted / drafted
    cooldown: int = 0  # steps left without drafting
    backoff: int = 8  # the next cooldown's length
    misses: int = 0  # prompt lookups in a row that found nothing


@dataclass
class SpecStats:
    """Counters since load (metrics and /health)."""

    verify_steps: int = 0  # forward passes that verified drafts
    plain_steps: int = 0  # steps decoded without speculation while it was on
    large_batch_steps: int = 0  # plain steps because the batch was above max_batch
    max_verify_batch: int = 0  # the most rows a verify step decoded
    drafts: int = 0  # rows that proposed a draft, summed over verify steps
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0  # tokens emitted by verify steps (accepted + one per row)
    row_steps: int = 0  # rows decoded by verify steps, summed
    pauses: int = 0  # times a row's acceptance fell below min_acceptance (it paused)
    # row steps without a draft because the row was paused (low acceptance; with prompt
    # lookup also its back-off after lookups that found nothing)
    paused_row_steps: int = 0

    def as_dict(self) -> dict[str, Any]:
        """What /health shows: the counters an operator needs to see whether speculation
        runs (verify vs plain steps, and why plain: a large batch, paused rows) and what it
        gains (acceptance, tokens per verify step)."""
        return {
            "verify_steps": self.verify_steps,
            "plain_steps": self.plain_steps,
            "large_batch_steps": self.large_batch_steps,
            "max_verify_batch": self.max_verify_batch,
            "pauses": self.pauses,
            "paused_row_steps": self.paused_row_steps,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            # the two counts behind tokens_per_step, so an interval's rate can be taken
            "emitted_tokens": self.emitted_tokens,
            "row_steps": self.row_steps,
            "acceptance_rate": (
                self.accepted_tokens / self.draft_tokens if self.draft_tokens else None
            ),
            "tokens_per_step": (self.emitted_tokens / self.row_steps if self.row_steps else None),
        }


@dataclass
class Speculator:
    """The engine's speculative-decoding policy: who drafts, how far, and when not at all."""

    mode: str  # "prompt-lookup" | "draft"
    num_draft: int = 6
    max_batch: int = 8
    min_acceptance: float = 0.3
    drafter: Any = None  # DraftModel in "draft" mode
    rows: dict[int, RowState] = field(default_factory=dict)
    stats: SpecStats = field(default_factory=SpecStats)
    # warm-up (LLMEngine._warm_verify_batches): every eligible row drafts every step, the
    # draft length cycling 1..num_draft by verify step, so each verify shape runs once
    warm: bool = False

    def register(self, uid: int, *, eligible: bool, dist: Any = None) -> None:
        """A row joins. Rows with logits processors (grammar, penalties, bias) or a seed
        are not drafted for: a grammar's state advances per token, and a seed promises the
        same text whatever shares the batch, which a load-dependent fallback would break."""
        self.rows[uid] = RowState(eligible=eligible, dist=dist, k=min(4, self.num_draft))

    def forget(self, uid: int) -> None:
        self.rows.pop(uid, None)
        if self.drafter is not None:
            self.drafter.forget(uid)

    def clear(self) -> None:
        for uid in list(self.rows):
            self.forget(uid)

    def drafts_with_model(self, uid: int) -> bool:
        """The row will be drafted for by a draft model (which needs its prompt first)."""
        st = self.rows.get(uid)
        return self.drafter is not None and st is not None and st.eligible

    def wants_draft(self, uid: int) -> bool:
        """Whether the row drafts this step (counts a paused row's step). Asked before the
        batch's pending tokens are read back, which synchronises with the device: a batch
        where no row drafts keeps mlx-lm's pipelined plain step."""
        st = self.rows.get(uid)
        if st is None or not st.eligible:
            return False
        if self.warm:
            return True
        if st.cooldown > 0:
            st.cooldown -= 1
            self.stats.paused_row_steps += 1
            return False
        return True

    def propose(self, uid: int, history: list[int], budget: int) -> list[int]:
        """The row's draft for this step (maybe empty); ``history`` ends with the pending
        token, ``budget`` is how many more tokens the row may still emit after it."""
        st = self.rows.get(uid)
        if st is None or not st.eligible:
            return []
        if self.warm:  # any draft verifies correctly; these only need the shapes
            k = min(1 + self.stats.verify_steps % self.num_draft, budget)
            return [history[-1]] * max(k, 0)
        k = min(st.k, budget)
        if k <= 0:
            return []
        if self.mode != "prompt-lookup":
            return self.drafter.propose(uid, history, k)
        draft = ngram_draft(np.asarray(history, dtype=np.int64), k)
        # Output that does not repeat its context finds nothing step after step: look
        # less often (up to every 16th step), each look being a device sync and a scan.
        st.misses = 0 if draft else st.misses + 1
        st.cooldown = min(max(st.misses - 1, 0), 16)
        return draft

    def update(self, uid: int, drafted: int, accepted: int) -> None:
        """Adapt the row's draft length: grow after a full acceptance, shrink to just past
        what was accepted otherwise; pause drafting when acceptance stays low."""
        st = self.rows.get(uid)
        if st is None or drafted == 0:
            return
        st.rate = 0.7 * st.rate + 0.3 * (accepted / drafted)
        if accepted == drafted:
            st.k = min(st.k + 2, self.num_draft)
        else:
            st.k = max(1, min(st.k, accepted + 1))
        if st.rate < self.min_acceptance:
            self.stats.pauses += 1
            st.cooldown, st.backoff = st.backoff, min(st.backoff * 2, 256)
            st.rate, st.k = 2 * self.min_acceptance + 0.1, 1
        elif accepted:
            st.backoff = 8


_WARM_ROW = -1  # the warm-up's row (the batch's uids count up from 0)


class DraftModel:
    """A small model that drafts greedily for each row, from a KV cache of its own.

    Rows draft one after another (each is a few single-token forward passes of the small
    model); the batch-size limit keeps that bounded. Each row's cache holds the tokens it
    has seen; before drafting it is cut back to what it shares with the row's accepted
    history (rejected drafts go) and fed the rest.
    """

    def __init__(
        self,
        model: Any,
        target_vocab: int,
        prefill_step_size: int = 512,
        max_catch_up: int | None = None,
    ) -> None:
        """``max_catch_up``: the most tokens one forward pass feeds into a row's non-empty
        cache (None: any number). On a GPU the engine sets it to the catch-up lengths the
        warm-up runs (``num_draft + 1``): a row that resumes drafting after a pause has
        more to catch up, and on an H200 such a pass (~10-20 tokens into a cache of ~200)
        met kernels nothing had run yet, 17-40 s for a quantized draft's first ones;
        in pieces it costs a few small passes (19-25 ms on first contact) instead."""
        self.model = model
        self.vocab = target_vocab
        self.step_size = prefill_step_size
        self.max_catch_up = max_catch_up
        self._rows: dict[int, tuple[list[Any], list[int]]] = {}

    def forget(self, uid: int) -> None:
        self._rows.pop(uid, None)

    def prefill(self, uid: int, tokens: list[int]) -> None:
        """Read a new row's prompt into its draft cache without waiting for it
        (``mx.async_eval``): queued after the step that emits the row's first token, so the
        draft's prompt pass delays neither that token nor the host, only the row's first
        draft, which :meth:`propose` then finds ready."""
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        self._feed(cache, tokens, mx.async_eval)
        self._rows[uid] = (cache, list(tokens))

    def _feed(
        self, cache: list[Any], tokens: list[int], evaluate: Any, size: int | None = None
    ) -> None:
        """Run ``tokens`` into ``cache`` ``size`` tokens (default a prefill chunk) at a
        time, each pass handed to ``evaluate`` (``mx.eval`` or ``mx.async_eval``) so the
        graph stays one pass deep."""
        size = size or self.step_size
        for i in range(0, len(tokens), size):
            self.model(mx.array(tokens[i : i + size])[None], cache=cache)
            evaluate([c.state for c in cache])

    def warm(self, tokens: list[int], num_draft: int) -> None:
        """Run what a row's drafting runs: its prompt pass, catch-up feeds of every length
        up to ``num_draft + 1`` tokens, then the drafting loop itself. On a GPU each kernel
        compiles on first contact, a quantized model's slowly; at load that costs nothing
        anyone waits for.

        The loop matters apart from the feeds: from its second token on it feeds the model
        the argmax it just took, a uint32 array where feeds are int32, and so another
        kernel for the quantized embedding's lookup. On an H200 that first draft of two
        tokens took 6 s after a warm-up without the loop, every other shape ~10-60 ms."""
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        self._feed(cache, tokens, mx.eval)
        seen = list(tokens)
        for n in range(1, num_draft + 2):
            mx.eval(self.model(mx.array(tokens[:n])[None], cache=cache))
            seen += tokens[:n]
        self._rows[_WARM_ROW] = (cache, seen)
        try:
            self.propose(_WARM_ROW, [*seen, tokens[0]], num_draft)
        finally:
            self.forget(_WARM_ROW)

    def propose(self, uid: int, history: list[int], k: int) -> list[int]:
        from mlx_lm.models.cache import make_prompt_cache

        cache, seen = self._rows.get(uid) or (make_prompt_cache(self.model), [])
        common = 0
        limit = min(len(seen), len(history) - 1)  # always feed at least the last token
        while common < limit and seen[common] == history[common]:
            common += 1
        if len(seen) > common:
            for c in cache:
                c.trim(len(seen) - common)
        feed = history[common:]
        size = self.step_size
        if common and self.max_catch_up:  # a cache that holds tokens: catch-up passes
            size = min(size, self.max_catch_up)
        ahead = (len(feed) - 1) // size * size  # all but the last pass
        self._feed(cache, feed[:ahead], mx.async_eval, size)
        feed = feed[ahead:]
        out: list[int] = []
        tok = mx.array(feed)[None]
        for i in range(k):
            logits = self.model(tok, cache=cache)[0, -1, : self.vocab]
            nxt = mx.argmax(logits)
            out.append(int(nxt.item()))
            if i + 1 < k:
                tok = nxt.reshape(1, 1)
        # the cache holds history and every draft but the last
        self._rows[uid] = (cache, list(history) + out[:-1])
        return out
