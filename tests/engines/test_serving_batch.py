"""engines/serving_batch.py: the engine core's prefill decodes what mlx-lm's does, and leaves
MLX's buffer cache to the decode steps that follow it instead of clearing it per chunk."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.utils import load

from mlxd.engines import serving_batch
from mlxd.engines.options import TextEngineOptions
from mlxd.engines.serving_batch import ServingBatchGenerator


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_llama):
    model, tokenizer = load(str(tiny_llama))
    return model, tokenizer


def _run(gen, prompts: list[list[int]], late: list[int] | None = None) -> dict[int, list[int]]:
    """Greedy tokens per uid; ``late`` is inserted once the first prompts decode."""
    uids = gen.insert(prompts, max_tokens=[8] * len(prompts))
    out: dict[int, list[int]] = {u: [] for u in uids}
    inserted = late is None
    for _ in range(100):
        _, responses = gen.next()
        for r in responses:
            out[r.uid].append(r.token)
        if not inserted and responses:
            out[gen.insert([late], max_tokens=[8])[0]] = []
            inserted = True
        if inserted and all(len(v) == 8 for v in out.values()):
            break
    return out


@pytest.mark.parametrize("prompt_end", [False, True])
def test_same_tokens_as_mlx_lm_across_padding_and_chunks(model_and_tokenizer, prompt_end):
    """Prompts of different lengths (right padding) and one longer than a prefill chunk
    (several chunks), plus a newcomer prefilled while the batch decodes; with the first
    token from mlx-lm's pass of the last prompt token, and from the prefill pass."""
    model, tok = model_and_tokenizer
    prompts = [
        tok.encode("the river runs to the sea"),
        tok.encode("a city"),
        tok.encode(" ".join(["ocean garden market"] * 12)),
    ]
    late = tok.encode("winter morning in the library")
    kw = dict(max_tokens=8, prefill_step_size=16, completion_batch_size=8, prefill_batch_size=4)
    ours = _run(ServingBatchGenerator(model, prompt_end=prompt_end, **kw), prompts, late)
    theirs = _run(BatchGenerator(model, **kw), prompts, late)
    assert list(ours.values()) == list(theirs.values())
    assert all(len(v) == 8 for v in ours.values())


def test_a_prefill_beside_a_running_batch_keeps_the_buffer_cache(model_and_tokenizer, monkeypatch):
    model, tok = model_and_tokenizer
    cached = {}
    for cls in (BatchGenerator, ServingBatchGenerator):
        gen = cls(model, max_tokens=8, prefill_step_size=8)
        gen.insert([tok.encode("the river runs to the sea")], max_tokens=[30])
        for _ in range(4):
            gen.next()  # prefilled, decoding
        gen.insert([tok.encode("a city of music and light")], max_tokens=[30])
        gen.next()  # decode step, then the newcomer's prefill (mlx-lm clears after it)
        cached[cls] = mx.get_cache_memory()
        mx.clear_cache()
    # mlx-lm's leaves only what was freed after its clear (a few bytes); ours the step's
    # buffers, for the next decode step to reuse
    assert cached[BatchGenerator] < 1024 < 16 * 1024 < cached[ServingBatchGenerator], cached
    # over the bound, the cache is cleared after all
    gen = ServingBatchGenerator(model, max_tokens=8, prefill_step_size=8)
    gen.insert([tok.encode("the river runs to the sea")], max_tokens=[30])
    gen.next()
    assert mx.get_cache_memory() > 0
    held = mx.get_cache_memory()
    serving_batch.trim_buffer_cache()  # under the bound: kept
    assert mx.get_cache_memory() == held
    monkeypatch.setattr(serving_batch, "CACHE_KEEP_BYTES", held - 1)
    serving_batch.trim_buffer_cache()  # over it: cleared
    assert mx.get_cache_memory() == 0


def test_the_engine_clears_the_buffer_cache_when_its_batch_runs_dry(tiny_llama):
    """Memory at rest is what mlx-lm leaves: the cache kept for decode steps is handed back
    once the last sequence has finished."""
    from mlxd.core.types import SamplingParams
    from mlxd.engines.llm import LLMEngine

    engine = LLMEngine("tiny", tiny_llama, TextEngineOptions(max_num_seqs=4, prefix_cache_bytes=0))
    engine.bind()
    seq = engine.new_sequence(
        engine.encode_prompt("the river runs to the sea"),
        SamplingParams(max_tokens=6, temperature=0.0),
    )
    engine.add(seq)
    held = []
    while not seq.finished:  # (on a GPU an idle batch first waits out a burst: 3 ms)
        engine.step()
        if not seq.finished:
            held.append(mx.get_cache_memory())
    assert seq.finished and max(held) > 0
    assert mx.get_cache_memory() == 0


def _decode_all(
    gen,
    prompts: list[list[int]],
    max_tokens: list[int],
    late: list[int] | None = None,
    cancel_at: int | None = None,
    processors: list[list] | None = None,
):
    """Every response per uid (token, finish, all_tokens, the finished row's KV as
    arrays), with ``late`` inserted at the first finish and the last prompt's row removed
    (a client gone) at step ``cancel_at``; ``processors``: each row's logits processors."""
    uids = gen.insert(prompts, max_tokens=max_tokens, logits_processors=processors)
    out: dict[int, list] = {u: [] for u in uids}
    kv: dict[int, list] = {}
    live = set(uids)
    for step in range(200):
        if not live:
            break
        _, responses = gen.next()
        for r in responses:
            out[r.uid].append((r.token, r.finish_reason))
            if r.finish_reason is not None:
                live.discard(r.uid)
                kv[r.uid] = (
                    r.all_tokens,  # as handed over, compared at the end
                    [mx.array(c.state[0]) for c in r.prompt_cache],
                )
                if late is not None:
                    (u,) = gen.insert([late], max_tokens=[5])
                    out[u], late = [], None
                    live.add(u)
        if step == cancel_at and uids[-1] in live:
            gen.remove([uids[-1]])
            live.discard(uids[-1])
    return out, kv


@pytest.mark.parametrize("prompt_end", [False, True])
def test_finished_rows_left_in_the_batch_change_nothing_but_the_reshapes(
    model_and_tokenizer, monkeypatch, prompt_end
):
    """``defer_leaves`` (a GPU's default): rows that finish one by one stay in the decode
    batch until half of it is finished or newcomers join, so mlx-lm filters the batch
    (a host read that waits for the device) a few times instead of once per finish. What
    every row emits, and the tokens and KV cache a finished row hands to the prefix cache,
    are mlx-lm's, through a join and through a cancel while finished rows are held."""
    from mlx_lm.generate import GenerationBatch

    model, tok = model_and_tokenizer
    prompts = [
        tok.encode(t)
        for t in (
            "the river runs to the sea",
            "a city",
            "winter morning in the library",
            "ocean garden",
            "a story of light",
            "music at night",
            "old stones",
            "the market opens",
        )
    ]
    max_tokens = [3, 4, 5, 6, 7, 8, 9, 10]
    filters = []
    real = GenerationBatch.filter
    monkeypatch.setattr(
        GenerationBatch,
        "filter",
        lambda self, keep: (filters.append(len(keep)), real(self, keep))[1],
    )
    kw = dict(max_tokens=8, completion_batch_size=8, prefill_batch_size=8)
    results = {}
    for name, gen in (
        ("mlx-lm", BatchGenerator(model, **kw)),
        ("deferred", ServingBatchGenerator(model, defer_leaves=True, prompt_end=prompt_end, **kw)),
    ):
        filters.clear()
        alone = _decode_all(gen, prompts, max_tokens)
        n_alone = len(filters)
        joined = _decode_all(gen, prompts, max_tokens, late=tok.encode("a late one"))
        # the same point of the rows' decoding: a step sooner where first tokens come
        # from the prefill pass
        cancelled = _decode_all(
            gen, prompts, max_tokens, cancel_at=4 - (name == "deferred" and prompt_end)
        )
        if name == "deferred":
            assert len(gen._generation_batch) == 0
        results[name] = (alone, joined, cancelled, n_alone)
    for i in (0, 1, 2):
        (ours, our_kv), (theirs, their_kv) = results["deferred"][i], results["mlx-lm"][i]
        assert list(ours.values()) == list(theirs.values())
        assert our_kv.keys() == their_kv.keys()
        for uid, (tokens, keys) in our_kv.items():
            assert tokens == their_kv[uid][0]
            # equal up to float rounding: a batch of another size may round differently
            assert all(
                a.shape == b.shape and mx.allclose(a, b, atol=1e-5).item()
                for a, b in zip(keys, their_kv[uid][1], strict=True)
            )
    # eight rows finishing one step apart: mlx-lm filters at every finish, the deferred
    # batch when half is finished (4 of 8), then at 2 of 4, 1 of 2 and the last
    assert results["mlx-lm"][3] == 8 and results["deferred"][3] == 4


def test_finished_rows_are_not_counted_as_running(model_and_tokenizer):
    """The batch's length (what mlx-lm's scheduler and the engine read) is its live rows."""
    model, tok = model_and_tokenizer
    gen = ServingBatchGenerator(
        model, defer_leaves=True, max_tokens=8, completion_batch_size=8, prefill_batch_size=8
    )
    gen.insert(
        [tok.encode(t) for t in ("one", "two two", "three three three")], max_tokens=[2, 6, 6]
    )
    while True:
        _, responses = gen.next()
        if any(r.finish_reason for r in responses):
            break
    batch = gen._generation_batch
    assert len(batch.uids) == 3 and len(batch) == 2  # one finished row still held


def test_an_engine_leaving_finished_rows_in_the_batch_serves_the_prefix_cache_alike(tiny_llama):
    """Through LLMEngine: rows finishing one by one with ``defer_leaves`` on, then each
    one's next turn served from the prefix cache, decode what they decode with it off."""
    from mlxd.core.types import SamplingParams
    from mlxd.engines.llm import LLMEngine

    def run(defer: bool) -> list[list[int]]:
        engine = LLMEngine(
            "tiny",
            tiny_llama,
            TextEngineOptions(
                max_num_seqs=8,
                prefix_cache_bytes=1 << 26,
                prefix_cache_min_tokens=4,
                defer_leaves=defer,
            ),
        )
        engine.bind()
        texts = [
            "the river runs to the sea",
            "a city of music",
            "winter morning",
            "ocean garden market",
            "a story of light and stone",
        ]
        out = []
        for turn in range(2):
            seqs = []
            for i, text in enumerate(texts):
                ids = engine.encode_prompt(text)
                if turn:  # the first turn's prompt and reply, then more
                    ids = ids + out[i] + engine.encode_prompt(" and then")
                seq = engine.new_sequence(ids, SamplingParams(max_tokens=3 + i, temperature=0.0))
                engine.add(seq)
                seqs.append(seq)
            got: dict[int, list[int]] = {}
            while not all(s.finished for s in seqs):
                for seq, ev in engine.step():
                    assert ev.error is None
                    if ev.token is not None:
                        got.setdefault(id(seq), []).append(ev.token)
            out += [got[id(s)] for s in seqs]
            if turn:
                assert all(s.cached_tokens > 0 for s in seqs)  # the cache served them
        return out

    assert run(defer=True) == run(defer=False)


def test_a_finished_row_held_in_the_batch_runs_no_processors_and_shares_a_sampler(
    model_and_tokenizer,
):
    """A held row's processors (a grammar past its end would fail) are never called again,
    and its sampler becomes a live row's, which keeps mlx-lm's one batched sampler call."""
    from mlx_lm.sample_utils import make_sampler

    model, tok = model_and_tokenizer
    calls: dict[str, int] = {"short": 0, "long": 0}

    def counting(name):
        def processor(tokens, logits):
            calls[name] += 1
            return logits

        return processor

    shared = make_sampler(temp=0.0)
    gen = ServingBatchGenerator(
        model, defer_leaves=True, max_tokens=8, completion_batch_size=8, prefill_batch_size=8
    )
    short, long_, other = gen.insert(
        [tok.encode("one"), tok.encode("two two"), tok.encode("three three three")],
        max_tokens=[2, 6, 6],
        samplers=[make_sampler(temp=0.0), shared, shared],
        logits_processors=[[counting("short")], [counting("long")], []],
    )
    finished = set()
    while len(finished) < 3:
        _, responses = gen.next()
        for r in responses:
            if r.finish_reason is not None:
                finished.add(r.uid)
                if r.uid == short:
                    at_finish = calls["short"]
                    batch = gen._generation_batch
                    i = batch.uids.index(short)
                    assert len(batch) == 2 and batch.logits_processors[i] == []
                    assert batch.samplers[i] is shared
    assert calls["short"] == at_finish and calls["long"] > at_finish


def _budgeted(gen, prompts: list[list[int]], late: list[int], n: int = 8):
    """Greedy tokens per uid, ``late`` inserted once the first prompts decode, and the
    tokens each step fed: (decode rows, prefill rows x longest chunk)."""
    steps: list[tuple[int, int]] = []
    real = gen.step_stats.record
    gen.step_stats.record = lambda decode, prefill: (
        steps.append((decode, prefill)),
        real(decode, prefill),
    )
    uids = gen.insert(prompts, max_tokens=[n] * len(prompts))
    out: dict[int, list[int]] = {u: [] for u in uids}
    inserted = False
    for _ in range(300):
        _, responses = gen.next()
        for r in responses:
            out[r.uid].append(r.token)
        if not inserted and responses:
            out[gen.insert([late], max_tokens=[n])[0]] = []
            inserted = True
        if inserted and all(len(v) == n for v in out.values()):
            break
    return list(out.values()), steps


@pytest.mark.parametrize("prompt_end", [False, True])
def test_greedy_tokens_are_the_same_under_any_step_budget(model_and_tokenizer, prompt_end):
    """Prompts of many lengths and a newcomer arriving while they decode: the same greedy
    tokens with no budget (mlx-lm's chunks), a large one and a tiny one, and every step
    of the budgeted runs within its budget, padding counted."""
    model, tok = model_and_tokenizer
    prompts = [
        tok.encode("the river runs to the sea"),
        tok.encode("a city"),
        tok.encode(" ".join(["ocean garden market"] * 12)),
        tok.encode(" ".join(["winter morning"] * 20)),
    ]
    late = tok.encode(" ".join(["a library of quiet rooms"] * 6))
    kw = dict(
        max_tokens=8,
        prefill_step_size=64,
        completion_batch_size=8,
        prefill_batch_size=4,
        prompt_end=prompt_end,
    )
    free, _ = _budgeted(ServingBatchGenerator(model, **kw), prompts, late)
    theirs = _run(
        BatchGenerator(
            model, max_tokens=8, prefill_step_size=64, completion_batch_size=8, prefill_batch_size=4
        ),
        prompts,
        late,
    )
    assert free == list(theirs.values())
    for budget in (4096, 40, 20):
        got, steps = _budgeted(
            ServingBatchGenerator(model, max_step_tokens=budget, **kw), prompts, late
        )
        assert got == free, budget
        assert all(len(v) == 8 for v in got)
        # decode rows first: a step's prefill fills what is left, and never less than
        # the least chunk a prompt gets
        over = [
            (d, p) for d, p in steps if d + p > max(budget, d + serving_batch.MIN_PREFILL_TOKENS)
        ]
        assert over == [], (budget, over)
        if budget == 20:  # the long prompts took many steps, prefill beside decode
            assert sum(1 for d, p in steps if p) > 2 * len(free[3]) // 20
            assert any(d and p for d, p in steps)


@pytest.mark.parametrize("prompt_end", [False, True])
def test_the_budget_shares_a_step_among_the_prompts_being_prefilled(
    model_and_tokenizer, prompt_end
):
    """Four long prompts at once under a budget of 64: each gets 16 tokens a step (one
    chunk length for all, the pass being padded to its longest), none waits for another."""
    model, tok = model_and_tokenizer
    gen = ServingBatchGenerator(
        model,
        max_tokens=4,
        prefill_step_size=512,
        prefill_batch_size=4,
        prompt_end=prompt_end,
        max_step_tokens=64,
    )
    gen.insert(
        [tok.encode(" ".join([w] * 30)) for w in ("ocean", "river", "sea", "lake")],
        max_tokens=[4] * 4,
    )
    prompt_responses, _ = gen.next()
    assert [r.progress[0] for r in prompt_responses] == [16, 16, 16, 16]
    assert gen.step_stats.largest_prefill_tokens == 64


def test_a_full_decode_batch_leaves_the_least_chunk_to_a_prompt(model_and_tokenizer):
    """Decode rows as many as the budget: a waiting prompt still gets its least chunk
    each step, and the prompt batch takes in no more newcomers than that feeds."""
    model, tok = model_and_tokenizer
    gen = ServingBatchGenerator(
        model,
        max_tokens=40,
        prefill_step_size=512,
        prefill_batch_size=8,
        completion_batch_size=16,
        prompt_end=True,
    )
    gen.insert([tok.encode(f"story {i}") for i in range(8)], max_tokens=[40] * 8)
    gen.next()
    assert len(gen._generation_batch) == 8
    gen.max_step_tokens = 8
    gen.insert(
        [tok.encode(" ".join(["ocean"] * 40)), tok.encode("a second one")], max_tokens=[4, 4]
    )
    prompt_responses, responses = gen.next()
    assert len(responses) == 8
    assert [r.progress[0] for r in prompt_responses] == [serving_batch.MIN_PREFILL_TOKENS]
    assert len(gen._unprocessed_sequences) == 1  # waits for room in the budget


def test_auto_is_paced_on_the_cpu_and_the_engine_shows_its_steps(tiny_llama):
    """engine.max_step_tokens 'auto' on the CPU steers each step from measured step times
    (engines/step_pace.py); the engine's stats (/health, /api/ps) show the budget, the
    decode step's measured cost and the chunk it allows beside decoding rows."""
    from mlxd.core.types import SamplingParams
    from mlxd.engines.llm import LLMEngine

    engine = LLMEngine("tiny", tiny_llama, TextEngineOptions(max_num_seqs=4, prefix_cache_bytes=0))
    engine.bind()
    first = engine.new_sequence(
        engine.encode_prompt("the river runs"), SamplingParams(max_tokens=40, temperature=0.0)
    )
    engine.add(first)
    for _ in range(6):
        engine.step()
    late = engine.new_sequence(
        engine.encode_prompt(" ".join(["ocean garden"] * 60)),
        SamplingParams(max_tokens=3, temperature=0.0),
    )
    engine.add(late)
    while not (first.finished and late.finished):
        engine.step()
    stats = engine.stats()["step_budget"]
    assert stats["adaptive"] is True
    assert stats["decode_step_ms"] > 0 and stats["prefill_chunk"] >= 16
    assert stats["prefill_steps"] >= 1
    off = LLMEngine("tiny", tiny_llama, TextEngineOptions(max_num_seqs=4, max_step_tokens=0))
    off.bind()
    assert off.stats()["step_budget"]["budget"] == 0
    assert off.stats()["step_budget"]["adaptive"] is False


def test_speculative_steps_count_their_drafts_and_decode_alike_under_a_budget(tiny_llama):
    """Prompt lookup verifies drafts in the decode pass: those tokens count against the
    step's budget, and greedy output is what it is without one."""
    from mlxd.core.types import SamplingParams
    from mlxd.engines.llm import LLMEngine

    texts = [
        " ".join(["ocean garden market"] * 8),
        "the river runs to the sea " * 3,
        " ".join(["winter morning library"] * 14),
    ]
    got, stats = [], []
    for budget in (0, 24):
        engine = LLMEngine(
            "tiny",
            tiny_llama,
            TextEngineOptions(
                max_num_seqs=4,
                prefix_cache_bytes=0,
                speculative="prompt-lookup",
                speculative_policy="always",
                max_step_tokens=budget,
            ),
        )
        engine.bind()
        steps: list[tuple[int, int]] = []
        real = engine._gen.step_stats.record
        engine._gen.step_stats.record = lambda d, p, real=real, steps=steps: (
            steps.append((d, p)),
            real(d, p),
        )
        seqs = [
            engine.new_sequence(
                engine.encode_prompt(t), SamplingParams(max_tokens=24, temperature=0.0)
            )
            for t in texts
        ]
        out: dict[int, list[int]] = {id(s): [] for s in seqs}
        for s in seqs:
            engine.add(s)
            s.t_added = 0.0
        for _ in range(400):
            if all(s.finished for s in seqs):
                break
            for seq, ev in engine.step():
                assert ev.error is None
                if ev.token is not None:
                    out[id(seq)].append(ev.token)
        got.append([out[id(s)] for s in seqs])
        stats.append((steps, engine.speculator.stats.verify_steps))
    assert got[0] == got[1] and all(len(t) == 24 for t in got[1])
    steps, verify_steps = stats[1]
    assert verify_steps > 0
    assert any(d > len(texts) for d, _ in steps)  # a verify step's drafts were counted
    assert all(d + p <= max(24, d + serving_batch.MIN_PREFILL_TOKENS) for d, p in steps)
    assert any(d and p for d, p in steps)


@pytest.mark.parametrize("defer_leaves", [False, True])
@pytest.mark.parametrize("prompt_end", [False, True])
def test_pipelined_steps_decode_what_stepwise_ones_do(
    model_and_tokenizer, defer_leaves, prompt_end
):
    """engine.pipeline_decode: with the next step in flight while a step's tokens are read
    (on) or each step evaluated before it returns (off), every row emits the same tokens
    and finish, and a finished row hands over the same tokens and KV cache: rows finishing
    by length (one after its first token) and by a stop token, a row with a logits
    processor, a newcomer joining mid-stream and a row removed mid-stream."""
    from mlx_lm.sample_utils import make_logits_processors

    model, tok = model_and_tokenizer
    prompts = [
        tok.encode(t)
        for t in ("the river runs to the sea", "a city", "old stones", "music at night")
    ]
    max_tokens = [1, 5, 9, 12]
    kw = dict(max_tokens=8, completion_batch_size=8, prefill_batch_size=8)
    probe, _ = _decode_all(ServingBatchGenerator(model, **kw), prompts, max_tokens)
    stop_token = list(probe.values())[2][3][0]  # row 2's fourth token ends it there
    penalty = make_logits_processors(repetition_penalty=1.5)
    results = {}
    for pipeline in (True, False):
        gen = ServingBatchGenerator(
            model,
            pipeline=pipeline,
            defer_leaves=defer_leaves,
            prompt_end=prompt_end,
            stop_tokens=[[stop_token]],
            **kw,
        )
        assert gen._generation_batch.pipeline is pipeline
        runs = [
            _decode_all(gen, prompts, max_tokens, processors=[[], [], penalty, []]),
            _decode_all(gen, prompts, max_tokens, late=tok.encode("a late one")),
            _decode_all(gen, prompts, max_tokens, cancel_at=3),
        ]
        assert len(gen._generation_batch) == 0
        results[pipeline] = runs
    for (ours, our_kv), (theirs, their_kv) in zip(results[True], results[False], strict=True):
        assert list(ours.values()) == list(theirs.values())
        assert [t for t, _ in our_kv.values()] == [t for t, _ in their_kv.values()]
        for (_, a), (_, b) in zip(our_kv.values(), their_kv.values(), strict=True):
            assert all(
                x.shape == y.shape and mx.array_equal(x, y).item()
                for x, y in zip(a, b, strict=True)
            )
    alone, joined, cancelled = (list(r[0].values()) for r in results[True])
    assert alone[0] == [(alone[0][0][0], "length")]  # max_tokens=1
    assert any(f == "stop" for run in (alone, joined, cancelled) for row in run for _, f in row)
    assert len(joined) == 5 and len(cancelled[3]) < 12


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_logprobs_read_on_the_host_are_the_devices(dtype):
    """A step's logprob rows are read from their evaluated buffers (an MLX op would queue
    behind the step in flight): the token's value and the top ids and values are what MLX
    computes from the same row, in every dtype a model decodes in (ids of tied values in
    either order)."""
    from mlxd.engines.decode import _device_logprob, _logprob, host_row

    x = mx.random.normal((3, 500), key=mx.random.key(0)).astype(dtype)
    rows = list(x - mx.logsumexp(x, axis=-1, keepdims=True))
    strided = x[0, ::2]  # no contiguous buffer: read through MLX ops instead
    mx.eval(rows, strided)
    assert host_row(strided) is None and host_row(rows[0]) is not None
    for row in [*rows, strided]:
        for top in (0, 1, 5):
            lp, ids, vals = _logprob(7, row, top)
            want_lp, _, want_vals = _device_logprob(7, row, top)
            assert (lp, vals) == (want_lp, want_vals) and len(set(ids)) == top
            assert [row[i].item() for i in ids] == vals


def test_an_unpadded_batch_decodes_without_a_mask_and_the_same_tokens(
    model_and_tokenizer, monkeypatch
):
    """``maskless_decode``: a row alone, or rows of one length, decode their one-token steps
    without building mlx-lm's attention mask, and emit what mlx-lm's masked batch does; a
    batch of padded rows keeps its mask."""
    from mlx_lm.models import cache as cache_module

    model, tok = model_and_tokenizer
    decode_masks = []
    real = cache_module.create_causal_mask

    def spy(n, *args, **kwargs):
        if n == 1:
            decode_masks.append(n)
        return real(n, *args, **kwargs)

    monkeypatch.setattr(cache_module, "create_causal_mask", spy)
    kw = dict(max_tokens=8, completion_batch_size=8, prefill_batch_size=8)
    alone = [tok.encode("the river runs to the sea")]
    even = [tok.encode("one two three")[:6], tok.encode("four five six")[:6]]
    padded = [tok.encode("a city"), tok.encode("winter morning in the old library")]
    assert len(even[0]) == len(even[1]) and len(padded[0]) != len(padded[1])
    masks = {}
    for prompts in (alone, even, padded):
        for name, gen in (
            ("mlx-lm", BatchGenerator(model, **kw)),
            ("ours", ServingBatchGenerator(model, **kw)),
        ):
            decode_masks.clear()
            out, _ = _decode_all(gen, prompts, [10] * len(prompts))
            masks[name, len(prompts[0])] = len(decode_masks)
            if name == "mlx-lm":
                theirs = list(out.values())
            else:
                assert list(out.values()) == theirs
        if prompts is padded:
            assert masks["ours", len(prompts[0])] > 0  # padded rows keep their mask
        else:
            # one: the group's first pass, which mlx-lm's own batch runs before it joins
            assert masks["ours", len(prompts[0])] <= 1 < 9 <= masks["mlx-lm", len(prompts[0])]
    # off: the batch builds mlx-lm's mask as before
    gen = ServingBatchGenerator(model, **kw)
    gen._generation_batch.maskless_decode = False
    decode_masks.clear()
    _decode_all(gen, alone, [10])
    assert decode_masks
