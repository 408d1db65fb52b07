"""Speculative decoding's pieces that know nothing of the batch: drafting, the acceptance
rule, each sequence's adaptive draft length, and whether a step speculates at all
(:class:`CostModel`, from measured step costs).

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
import math
import time
from collections.abc import Callable
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


def batch_bucket(n: int) -> int:
    """The power of two at or below ``n``: the batch sizes that share a cost estimate."""
    return 1 << (max(n, 1).bit_length() - 1)


@dataclass
class BucketCost:
    """What one batch-size bucket has measured: a plain step's wall time, a speculating
    step's, and the tokens each row emitted per speculating step (EWMAs)."""

    plain_s: float | None = None
    spec_s: float | None = None
    spec_tokens: float | None = None  # tokens per row per speculating step
    plain_samples: int = 0
    spec_samples: int = 0
    speculate: bool = False  # the current decision
    since: int = 0  # steps decided since the other mode was last tried
    explore_every: int = 32  # steps between tries of the other mode (doubles while it loses)
    burst: int = 0  # steps left of a try of the other mode
    burst_mode: bool = False  # the mode being tried
    trying: bool | None = None  # the decision a try started from, until it is judged

    def gain(self) -> float | None:
        """Speculation's tokens/s over plain decoding's; None until both are measured."""
        if self.plain_s is None or self.spec_s is None or self.spec_tokens is None:
            return None
        return self.spec_tokens * self.plain_s / max(self.spec_s, 1e-9)

    def as_dict(self) -> dict[str, Any]:
        gain = self.gain()
        return {
            "decision": "speculate" if self.speculate else "plain",
            "plain_step_ms": None if self.plain_s is None else round(self.plain_s * 1e3, 3),
            "spec_step_ms": None if self.spec_s is None else round(self.spec_s * 1e3, 3),
            "spec_tokens_per_row": (
                None if self.spec_tokens is None else round(self.spec_tokens, 3)
            ),
            "gain": None if gain is None else round(gain, 3),
            "plain_samples": self.plain_samples,
            "spec_samples": self.spec_samples,
        }


class CostModel:
    """Whether a step speculates, from what steps of each kind have cost at this batch
    size: prompt lookup doubled the rate at batch 1 but lost up to a third at 16 (H200),
    and where the line falls depends on the model, the device and the text.

    A step's cost is the wall time from the end of the step before it to its own end, so
    it holds everything the step made the engine wait for: the host read of its tokens,
    the lookup, the verify pass, the rollback. A plain step leaves its next forward pass
    in flight (mlx-lm's pipelining), which the following step waits for; so a step whose
    predecessor was of the other kind, or was separated from it by a prefill, gives no
    sample. Speculating wins when tokens per row per step over its step time beats one
    token over a plain step's by ``margin``. The losing kind is retried for a few steps
    now and then (every ``explore_min`` decisions, doubling while it keeps losing, up to
    ``explore_max``), so the estimates follow the text and the batch as they change; never
    more often than keeps the time those tries lose under ``explore_budget`` of the
    decode time (on a CPU a 16-row verify pass costs ~4 plain steps, so a try every 32
    steps lost a quarter of the time). A batch size not seen yet tries speculation at
    once, unless a smaller one found it slower: a verify pass only grows dearer with rows.
    """

    def __init__(
        self,
        *,
        alpha: float = 0.3,
        margin: float = 0.05,
        min_samples: int = 2,
        burst: int = 3,
        explore_min: int = 32,
        explore_max: int = 1024,
        explore_budget: float = 0.02,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.alpha, self.margin, self.min_samples, self.burst = alpha, margin, min_samples, burst
        self.explore_min, self.explore_max = explore_min, explore_max
        self.explore_budget = explore_budget
        self.clock = clock
        self.buckets: dict[int, BucketCost] = {}
        self._last: tuple[int, bool] | None = None  # the previous step's bucket and kind
        self._t_last = 0.0

    def _bucket(self, n: int) -> BucketCost:
        b = batch_bucket(n)
        cost = self.buckets.get(b)
        if cost is None:
            known = [k for k, c in self.buckets.items() if k < b and c.gain() is not None]
            below = self.buckets[max(known)] if known else None
            gain = below.gain() if below is not None else None
            if below is not None and gain is not None and gain < 1:
                # slower with fewer rows: the first try waits as long as the retries there
                cost = self.buckets[b] = BucketCost(explore_every=below.explore_every, since=0)
            else:  # the first try of speculation comes with the first decision
                cost = self.buckets[b] = BucketCost(
                    explore_every=self.explore_min, since=self.explore_min - 1
                )
        return cost

    def _loss_interval(self, c: BucketCost) -> int:
        """The fewest decisions between two tries of the losing kind that keep the time
        they lose under ``explore_budget``: a try runs ``burst`` steps of the loser, each
        losing the part of its time the winner would have emitted its tokens in."""
        gain = c.gain()
        if gain is None or c.plain_s is None or c.spec_s is None or gain <= 0:
            return self.explore_min
        if gain >= 1:  # speculation wins: a try runs plain steps
            lose, win, ratio = c.plain_s, c.spec_s, gain
        else:
            lose, win, ratio = c.spec_s, c.plain_s, 1 / gain
        lost = self.burst * lose / max(win, 1e-9) * (1 - 1 / ratio)  # in winning steps
        return math.ceil(lost / self.explore_budget)

    def choose(self, n: int) -> bool:
        """Whether a step of ``n`` rows speculates."""
        c = self._bucket(n)
        if c.burst:
            c.burst -= 1
            return c.burst_mode
        if c.plain_samples < self.min_samples:
            return False  # plain decoding first: the yardstick, and safe
        decision = self._decide(c)
        if c.trying is not None:  # a try just ended: what it confirmed is retried less often
            if c.gain() is not None:
                confirmed = decision == c.trying
                rule = 2 * c.explore_every if confirmed else self.explore_min
                c.explore_every = min(max(rule, self._loss_interval(c)), self.explore_max)
            c.trying = None
        c.speculate = decision
        c.since += 1
        if c.since >= c.explore_every:
            c.trying, c.burst_mode = decision, not decision
            c.burst, c.since = self.burst - 1, 0
            return c.burst_mode
        return decision

    def _decide(self, c: BucketCost) -> bool:
        """Speculate where it measured faster; never where it emits no more tokens per
        row than a plain step (its step then costs at least a plain one, and a measured
        gain is noise: a loaded host's wall times)."""
        gain = c.gain()
        tokens = c.spec_tokens or 0.0
        return gain is not None and tokens > 1 + self.margin and gain > 1 + self.margin

    def interrupt(self) -> None:
        """Something ran between two steps (a prefill, rows joining): the next step's
        wall time is not its own."""
        self._last = None

    def step_done(self, n: int, speculated: bool, tokens_per_row: float) -> None:
        """A step of ``n`` rows ended now; it speculated or not and emitted this many
        tokens per row."""
        now = self.clock()
        b = batch_bucket(n)
        if self._last == (b, speculated):
            self._sample(self._bucket(n), speculated, now - self._t_last, tokens_per_row)
        self._last, self._t_last = (b, speculated), now

    def _sample(self, c: BucketCost, speculated: bool, seconds: float, tokens: float) -> None:
        a = self.alpha
        if speculated:
            c.spec_samples += 1
            if c.spec_s is None or c.spec_tokens is None:
                c.spec_s, c.spec_tokens = seconds, tokens
            else:
                c.spec_s += a * (min(seconds, 4 * c.spec_s) - c.spec_s)
                c.spec_tokens += a * (tokens - c.spec_tokens)
        else:
            c.plain_samples += 1
            if c.plain_s is None:
                c.plain_s = seconds
            else:
                c.plain_s += a * (min(seconds, 4 * c.plain_s) - c.plain_s)

    def as_dict(self) -> dict[str, Any]:
        return {str(b): self.buckets[b].as_dict() for b in sorted(self.buckets)}


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
    cost_plain_steps: int = 0  # plain steps because plain decoding measured faster
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
            "cost_plain_steps": self.cost_plain_steps,
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
    max_batch: int = 0  # the most rows a verify step may hold; 0: no cap
    min_acceptance: float = 0.3
    # "cost": a step speculates when that measured faster at its batch size (CostModel);
    # "always": whenever a row has a draft
    policy: str = "cost"
    drafter: Any = None  # DraftModel in "draft" mode
    rows: dict[int, RowState] = field(default_factory=dict)
    stats: SpecStats = field(default_factory=SpecStats)
    cost: CostModel = field(default_factory=CostModel)
    # warm-up (LLMEngine._warm_verify_batches): every eligible row drafts every step, the
    # draft length cycling 1..num_draft by verify step, so each verify shape runs once
    warm: bool = False

    def speculates(self, n: int) -> bool:
        """Whether a step of ``n`` rows may draft (counts the plain steps it rules)."""
        if self.warm:
            return True
        if self.max_batch and n > self.max_batch:
            self.stats.plain_steps += 1
            self.stats.large_batch_steps += 1
            return False
        if self.policy == "always" or self.cost.choose(n):
            return True
        self.stats.plain_steps += 1
        self.stats.cost_plain_steps += 1
        return False

    def step_done(self, n: int, speculated: bool, tokens: int) -> None:
        """A step of ``n`` rows that emitted ``tokens`` ended: its cost, for the rule."""
        if not self.warm:
            self.cost.step_done(n, speculated, tokens / n)

    def reset_measurements(self) -> None:
        """Forget counters and costs (the warm-up's are nobody's, and on a GPU they
        include compiling each shape)."""
        self.stats = SpecStats()
        self.cost = CostModel(clock=self.cost.clock)

    def as_dict(self) -> dict[str, Any]:
        """/health: the counters, and per batch-size bucket what the rule measured and
        decided."""
        return {
            "policy": self.policy,
            "max_batch": self.max_batch or None,
            **self.stats.as_dict(),
            "buckets": self.cost.as_dict() if self.policy == "cost" else {},
        }

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
