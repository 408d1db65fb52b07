"""The pieces of speculative decoding that decide correctness: the rejection-sampling rule
(emitted tokens follow the target distribution, checked on a small vocabulary with many
draws), the distribution it is given being the one the row's sampler draws from, greedy
verification, prompt lookup, and the adaptive draft length."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from mlxd.core.types import SamplingParams
from mlxd.engines.options import TextEngineOptions
from mlxd.engines.sampling import build_sampler, sampling_probs
from mlxd.engines.speculative import (
    Speculator,
    ngram_draft,
    verify_greedy,
    verify_sampled,
)

N = 200_000  # draws per check: the frequencies' standard error is about 0.001
V = 6


def _dist(rng: np.random.Generator) -> np.ndarray:
    p = rng.dirichlet(np.ones(V) * 0.7)
    return p / p.sum()


def _freq(tokens: np.ndarray) -> np.ndarray:
    return np.bincount(tokens, minlength=V) / max(len(tokens), 1)


def _emitted(
    drafts: np.ndarray, accepted: np.ndarray, nxt: np.ndarray, pos: int
) -> tuple[np.ndarray, np.ndarray]:
    """Token ``pos`` of each row's output (drafts[:a] + [next]) where the row has one."""
    has = accepted >= pos
    tok = np.where(accepted > pos, drafts[:, min(pos, drafts.shape[1] - 1)], nxt)
    return tok[has], has


@pytest.mark.parametrize("one_hot", [True, False])
def test_rejection_sampling_follows_the_target_distribution(one_hot):
    rng = np.random.default_rng(0)
    p = np.stack([_dist(rng), _dist(rng), _dist(rng)])  # target at 3 positions (K = 2)
    q = np.stack([_dist(rng), _dist(rng)])  # draft at the 2 drafted positions
    if one_hot:  # a deterministic drafter (prompt lookup, greedy draft model): a good guess
        drafts = np.tile(np.array([int(np.argmax(p[0])), int(np.argmax(p[1]))]), (N, 1))
        q_arg = None
    else:
        drafts = np.stack([rng.choice(V, size=N, p=q[0]), rng.choice(V, size=N, p=q[1])], 1)
        q_arg = mx.broadcast_to(mx.array(q, dtype=mx.float32)[None], (N, 2, V))
    acc, nxt = verify_sampled(
        mx.broadcast_to(mx.array(p, dtype=mx.float32)[None], (N, 3, V)),
        mx.array(drafts),
        mx.full((N,), 2, dtype=mx.int32),
        q=q_arg,
        key=mx.random.key(1),
    )
    acc, nxt = np.array(acc), np.array(nxt)
    first, _ = _emitted(drafts, acc, nxt, 0)
    assert np.abs(_freq(first) - p[0]).max() < 0.006
    # the second token, wherever the first was a draft token (the target is p[1] after any
    # first token here), follows p[1]; the third, after two accepted drafts, p[2]
    second, _ = _emitted(drafts, acc, nxt, 1)
    assert np.abs(_freq(second) - p[1]).max() < 0.01
    third, _ = _emitted(drafts, acc, nxt, 2)
    assert len(third) > 1000 and np.abs(_freq(third) - p[2]).max() < 0.03
    # and drafts are really taken: acceptance of token 1 is sum(min(p, q))
    expected = np.minimum(p[0], q[0]).sum() if not one_hot else p[0][drafts[0, 0]]
    assert abs((acc >= 1).mean() - expected) < 0.006


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=3),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=0.6, top_k=6, top_p=0.9, min_p=0.05),
    ],
    ids=["temperature", "top_p", "top_k", "min_p", "all"],
)
def test_sampling_probs_is_the_distribution_the_sampler_draws_from(params):
    """Verification accepts drafts against ``sampling_probs``; if it differed from what the
    row's own sampler draws from (filter order, temperature before or after top_p...),
    speculation would change a sampled row's distribution. Many seeded draws from the real
    sampler must match it, and the tokens its filters drop must never be drawn."""
    v = 10
    rng = np.random.default_rng(3)
    logits = mx.array(rng.normal(size=(1, v)) * 1.5, dtype=mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    want = np.array(sampling_probs(params, v)(logprobs))[0]
    assert abs(want.sum() - 1) < 1e-5
    seeded = dataclasses.replace(params, seed=5)
    draws = np.array(build_sampler(seeded, v)(mx.broadcast_to(logprobs, (N, v))))
    freq = np.bincount(draws, minlength=v) / N
    assert np.abs(freq - want).max() < 0.006
    assert set(np.flatnonzero(freq)) == set(np.flatnonzero(want > 0))
    if params.top_k or params.top_p < 1 or params.min_p:
        assert (want == 0).any()  # the filters did drop something: the check had teeth


def test_rows_draft_different_lengths():
    """A row with a shorter draft (padded) samples after its last real draft token."""
    p = np.zeros((2, 3, V), dtype=np.float32)
    p[:, 0, 1] = p[:, 1, 2] = p[:, 2, 3] = 1.0  # the target is certain: 1, then 2, then 3
    drafts = mx.array([[1, 2], [1, 5]])  # row 1's second token is padding
    acc, nxt = verify_sampled(mx.array(p), drafts, mx.array([2, 1]), key=mx.random.key(0))
    assert acc.tolist() == [2, 1] and nxt.tolist() == [3, 2]
    acc, nxt = verify_sampled(mx.array(p), drafts, mx.array([0, 0]), key=mx.random.key(0))
    assert acc.tolist() == [0, 0] and nxt.tolist() == [1, 1]


def test_greedy_verification_takes_the_matching_prefix_and_the_argmax_after_it():
    logits = mx.zeros((3, 4, V))
    best = [[1, 2, 3, 4], [1, 2, 3, 4], [5, 5, 5, 5]]
    for r, row in enumerate(best):
        for j, t in enumerate(row):
            logits[r, j, t] = 1.0
    drafts = mx.array([[1, 2, 3], [1, 0, 3], [5, 5, 5]])
    acc, nxt = verify_greedy(logits, drafts, mx.array([3, 3, 1]))
    assert acc.tolist() == [3, 1, 1]
    assert nxt.tolist() == [4, 2, 5]


def test_prompt_lookup_copies_what_followed_the_last_ngram():
    toks = np.array([7, 1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert ngram_draft(toks, 3) == [4, 5, 9]
    assert ngram_draft(toks, 10) == [4, 5, 9, 1, 2, 3]  # up to the end of the history
    # the most recent earlier occurrence wins, and longer n-grams before shorter ones
    toks = np.array([1, 2, 8, 0, 1, 2, 6, 3, 1, 2])
    assert ngram_draft(toks, 2) == [6, 3]
    assert ngram_draft(np.array([4, 5, 6, 7]), 3) == []  # nothing repeats
    assert ngram_draft(np.array([1, 2, 1, 2]), 0) == []


def test_draft_length_adapts_and_low_acceptance_pauses_drafting():
    spec = Speculator("prompt-lookup", num_draft=6, min_acceptance=0.3)
    spec.register(1, eligible=True)
    spec.register(2, eligible=False)
    history = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    assert not spec.wants_draft(2)  # ineligible rows (processors, seeds) never draft
    assert spec.propose(2, history, 10) == []
    assert spec.wants_draft(1)
    assert spec.propose(1, history, 10) == [7, 8, 5, 6]  # starts at 4
    assert spec.propose(1, history, 2) == [7, 8]  # never past max_tokens
    spec.update(1, 4, 4)
    assert spec.rows[1].k == 6  # all accepted: longer drafts
    spec.update(1, 6, 1)
    assert spec.rows[1].k == 2  # shrinks to just past what was accepted
    for _ in range(4):
        spec.update(1, 2, 0)
    st = spec.rows[1]
    assert st.cooldown > 0  # acceptance fell below the floor: plain decoding for a while
    assert spec.stats.pauses == 1
    pause = st.cooldown
    assert not any(spec.wants_draft(1) for _ in range(pause))
    assert spec.stats.paused_row_steps == pause  # what /health reports
    assert spec.wants_draft(1)
    assert spec.propose(1, history, 10) == [7]  # then it tries again, one token at a time


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from fixtures.tiny_models import make_tiny_chat_model

    return make_tiny_chat_model(tmp_path_factory.mktemp("m") / "tiny", "llama")


def test_a_rotating_cache_serves_without_speculation_and_says_why(tiny):
    from mlxd.engines.llm import LLMEngine

    engine = LLMEngine("t", tiny, TextEngineOptions(speculative="prompt-lookup", max_kv_size=64))
    try:
        assert engine.speculator is None
        assert "max_kv_size" in engine.stats()["speculative"]["reason"]
    finally:
        engine.close()


def test_prompt_lookup_that_keeps_finding_nothing_looks_less_often():
    spec = Speculator("prompt-lookup")
    spec.register(1, eligible=True)
    fresh = [1, 2, 3, 4, 5, 6]  # no n-gram repeats
    looks = 0
    for _ in range(40):
        if spec.wants_draft(1):
            looks += 1
            assert spec.propose(1, fresh, 4) == []
    assert 4 <= looks < 12
    spec.rows[1].cooldown = 0
    assert spec.propose(1, [1, 2, 3, 1, 2], 4) == [3, 1, 2]  # a hit: back to every step
    assert spec.rows[1].cooldown == 0


def test_rolling_rows_back_leaves_the_cache_of_the_accepted_tokens(tiny):
    """Two rows of different lengths verify 3 drafts; one keeps all, one drops 2 and one
    drops 3. The next step's logits equal those of caches that only ever saw the kept
    tokens (positions, padding and mask all right)."""
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache
    from mlx_lm.utils import load

    from mlxd.engines.spec_batch import rollback_rows

    model, _ = load(str(tiny))
    rows = [[5, 9, 14, 3, 8, 21, 7], [11, 4, 6], [30, 31, 32, 33]]
    verify = [[40, 41, 42, 43], [50, 51, 52, 53], [60, 61, 62, 63]]  # pending + 3 drafts
    drop = [0, 2, 3]
    width = max(map(len, rows))
    pad = [width - len(r) for r in rows]
    caches = [BatchKVCache(pad) for _ in model.layers]
    model(mx.array([[0] * p + r for p, r in zip(pad, rows, strict=True)]), cache=caches)
    model(mx.array(verify), cache=caches)
    rollback_rows(caches, drop)
    nxt = mx.array([[70], [71], [72]])
    got = model(nxt, cache=caches)[:, -1]
    for i, (r, v, d) in enumerate(zip(rows, verify, drop, strict=True)):
        ref = make_prompt_cache(model)
        kept = r + v[: len(v) - d]
        want = model(mx.array([kept + [70 + i]]), cache=ref)[0, -1]
        assert mx.allclose(got[i], want, atol=1e-4).item(), i


def test_warm_up_drafts_every_length_in_turn_whatever_the_row_did():
    """Warm-up forces a draft on every eligible row at every step, its length cycling
    1..num_draft by verify step, so every verify shape meets MLX before a request does;
    rows that may not draft still do not."""
    spec = Speculator("prompt-lookup", num_draft=3)
    spec.register(1, eligible=True)
    spec.register(2, eligible=False)
    spec.rows[1].cooldown = 5  # a paused row drafts anyway while warming
    spec.warm = True
    assert spec.wants_draft(1) and not spec.wants_draft(2)
    lengths = []
    for _ in range(6):
        lengths.append(len(spec.propose(1, [9, 4, 7], 10)))
        spec.stats.verify_steps += 1
    assert lengths == [1, 2, 3, 1, 2, 3]
    assert spec.propose(1, [9, 4, 7], 1) == [7]  # never past max_tokens
    spec.warm = False
    assert not spec.wants_draft(1)  # back to the row's own pause


def test_loading_with_speculation_runs_verify_steps_in_the_warm_up(tiny):
    from mlxd.engines.llm import LLMEngine

    engine = LLMEngine(
        "t", tiny, TextEngineOptions(speculative="prompt-lookup", speculative_max_batch=4)
    )
    try:
        engine.bind()
        seen = []
        real_verify = engine.speculator.propose

        def spy(uid, history, budget):
            draft = real_verify(uid, history, budget)
            seen.append((engine.speculator.warm, len(draft)))
            return draft

        engine.speculator.propose = spy
        engine.warmup()
        warm_lengths = {k for w, k in seen if w and k}  # 0: the last token, no room
        assert warm_lengths == set(range(1, engine.speculator.num_draft + 1))
        assert not engine.speculator.warm
        assert engine.speculator.stats.verify_steps == 0  # nobody's statistics
    finally:
        engine.close()


def test_a_draft_models_prompt_pass_waits_until_the_rows_first_token_is_out(tiny):
    """With a draft model, a new row's first token comes from a step without drafts (the
    draft's pass over the prompt would hold it back), that pass is queued right after, and
    the row then drafts from the cache it built: the same greedy text as without a draft."""
    from mlxd.engines.llm import LLMEngine

    prompt = [1, 5, 9, 13, 17, 21, 25, 29]
    params = SamplingParams(max_tokens=8, temperature=0.0)

    def run(engine: LLMEngine) -> tuple[list[int], list[tuple[int, int]]]:
        seq = engine.new_sequence(list(prompt), params)
        engine.add(seq)
        tokens, steps = [], []
        while not seq.finished:
            for s, ev in engine.step():
                if s is seq and ev.token is not None:
                    tokens.append(ev.token)
            st = engine.speculator.stats if engine.speculator else None
            steps.append((len(tokens), st.verify_steps if st else 0))
        return tokens, steps

    plain = LLMEngine("p", tiny)
    drafted = LLMEngine(
        "d",
        tiny,
        TextEngineOptions(speculative="draft", draft_path=tiny, speculative_policy="always"),
    )
    try:
        plain.bind()
        drafted.bind()
        drafted.warmup()
        want, _ = run(plain)
        prefilled = []
        real = drafted.speculator.drafter.prefill

        def spy(uid: int, tokens: list[int]) -> None:
            prefilled.append(list(tokens))
            real(uid, tokens)

        drafted.speculator.drafter.prefill = spy
        got, steps = run(drafted)
        assert got == want
        assert prefilled == [prompt]  # the prompt, once, for the one row
        first = next(i for i, (n, _) in enumerate(steps) if n > 0)
        assert steps[first] == (1, 0)  # the first token came out of a plain step
        assert steps[-1][1] > 0  # later steps verified the self-draft's tokens
        assert drafted.speculator.stats.accepted_tokens > 0
    finally:
        plain.close()
        drafted.close()


class _FeedSpy:
    """A model that records each forward pass's input width (and dtype) and runs it."""

    def __init__(self, model, widths: list[int], dtypes: list | None = None) -> None:
        # not "model": mlx-lm's models keep their body under that name
        self._wrapped, self.widths, self.dtypes = model, widths, dtypes

    def __call__(self, x, cache=None):
        self.widths.append(x.shape[1])
        if self.dtypes is not None:
            self.dtypes.append(x.dtype)
        return self._wrapped(x, cache=cache)

    def __getattr__(self, name):
        return getattr(self._wrapped, name)


def test_a_gpu_warm_up_runs_longer_prompts_and_the_draft_models_own_shapes(tiny, monkeypatch):
    """Where MLX compiles per shape (a GPU: forced here on the CPU), the warm-up also
    prefills prompts of 128 tokens and of a whole prefill chunk (within the model's
    context), and runs the draft model itself, which forced drafts never do: its prompt
    pass at each of those lengths and every catch-up length up to num_draft + 1 (an H200
    served a quantized draft's first request at 2.7 tokens/s without this), and its
    drafting loop."""
    import mlxd.engines.llm as llm

    monkeypatch.setattr(llm, "compiles_per_shape", lambda: True)
    engine = llm.LLMEngine(
        "d",
        tiny,
        TextEngineOptions(
            speculative="draft", draft_path=tiny, max_num_seqs=4, prefill_step_size=200
        ),
    )
    try:
        engine.bind()
        prompts, fed, dtypes = [], [], []
        real_add = engine.add

        def spy_add(seq):
            prompts.append(len(seq.prompt_tokens))
            real_add(seq)

        drafter = engine.speculator.drafter
        real_model = drafter.model

        engine.add = spy_add
        drafter.model = _FeedSpy(real_model, fed, dtypes)
        engine.warmup()
        short = min(prompts)
        assert {128, 200} <= set(prompts) and short < 128
        # the draft's prompt passes (short, 128, 200 tokens) and catch-ups of 1..num_draft+1
        assert {short, 128, 200} <= set(fed)
        assert set(range(1, engine.speculator.num_draft + 2)) <= set(fed)
        # and the drafting loop, which feeds the model its own argmax (uint32: another
        # kernel on a GPU than the int32 feeds'), leaving no warm-up row behind
        assert mx.int32 in dtypes and mx.uint32 in dtypes
        assert not drafter._rows
        assert engine.speculator.stats.verify_steps == 0
        drafter.model = real_model
        seq = engine.new_sequence([1, 5, 9, 13], SamplingParams(max_tokens=4, temperature=0))
        real_add(seq)
        while not seq.finished:  # the engine serves as before after such a warm-up
            engine.step()
        assert seq.generated == 4
    finally:
        engine.close()


def test_a_draft_catches_up_in_passes_no_longer_than_the_warm_up_ran(tiny):
    """With ``max_catch_up`` (set on a GPU: the catch-up lengths the warm-up runs), a row
    that resumes drafting after a pause feeds what it missed in passes of at most that
    many tokens, never one longer pass (on an H200 a quantized draft's first such pass
    took 17-40 s), and drafts what one pass would have drafted."""
    from mlx_lm import load

    from mlxd.engines.speculative import DraftModel

    model, _ = load(str(tiny))
    prompt = [1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45]
    missed = [50 + 3 * i for i in range(11)]  # eleven tokens the paused row did not see
    widths: list[int] = []

    def drafts(max_catch_up: int | None) -> list[int]:
        drafter = DraftModel(
            _FeedSpy(model, widths), 1000, prefill_step_size=64, max_catch_up=max_catch_up
        )
        drafter.prefill(7, prompt)
        widths.clear()
        return drafter.propose(7, prompt + missed, 3)

    whole = drafts(None)
    assert widths[0] == len(missed)  # the missed tokens in one pass, then 2 draft steps
    pieces = drafts(4)
    assert pieces == whole
    # 11 tokens in passes of at most 4 (4, 4, then 3 with the first draft step), then the
    # two further draft steps of one token each
    assert widths == [4, 4, 3, 1, 1]
