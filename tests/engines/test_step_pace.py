"""engines/step_pace.py: 'auto' on the CPU steers each step's prefill chunk towards
STALL decode steps of cost, from step times it is given (no clock here)."""

from __future__ import annotations

from mlxd.engines.step_pace import MIN_PREFILL_TOKENS, STALL, StepPace


def _cost(fixed: float, per_token: float):
    return lambda n: fixed + per_token * n


def test_nothing_decoding_is_no_bound_and_the_fallback_comes_before_measures():
    pace = StepPace(fallback=256, most=1024)
    assert pace.prefill_tokens(0) is None
    assert pace.prefill_tokens(8) == 248


def test_the_chunk_settles_where_a_step_costs_stall_decode_steps():
    """A model whose pass has a large fixed cost (SmolLM2 on a CPU) and one whose tokens
    are cheap (a tiny one): the chunk converges to the length whose cost over a decode
    step is STALL decode steps, never moving more than 2x a step."""
    for fixed, per_token in ((0.10, 0.004), (0.002, 0.00005)):
        decode = 0.1 if fixed > 0.05 else 0.03
        cost = _cost(fixed, per_token)
        pace = StepPace(fallback=256, most=4096)
        pace.observe(0, 480, cost(480))  # the streams' own prompts, alone
        for _ in range(5):
            pace.observe(8, 0, decode)
        before = None
        for _ in range(40):
            n = pace.prefill_tokens(8)
            assert n is not None
            if before is not None:
                assert before / 2 - 1 <= n <= before * 2 + 1
            pace.observe(8, n, decode + cost(n))
            before = n
        target = (STALL * decode - fixed) / per_token
        assert abs(pace.prefill_tokens(8) - target) <= 0.05 * target + 1


def test_a_chunk_cut_short_by_its_prompt_does_not_shrink_the_next():
    pace = StepPace(fallback=256, most=4096)
    pace.observe(8, 0, 0.03)
    pace.observe(8, 200, 0.03 + 0.03)  # under the aim: grows
    grown = pace.prefill_tokens(8)
    pace.observe(8, 20, 0.03 + 0.003)  # a prompt's last 20 tokens
    assert pace.prefill_tokens(8) == grown


def test_the_chunk_stays_within_its_bounds():
    pace = StepPace(fallback=256, most=512)
    pace.observe(8, 0, 0.01)
    for _ in range(20):
        pace.observe(8, pace.prefill_tokens(8) or 0, 0.0105)  # tokens nearly free
    assert pace.prefill_tokens(8) == 512
    for _ in range(20):
        pace.observe(8, pace.prefill_tokens(8) or 0, 5.0)  # each step far too slow
    assert pace.prefill_tokens(8) == MIN_PREFILL_TOKENS


def test_a_mixed_pass_starts_from_the_whole_guess():
    """Before a step with a chunk is measured, the chunk is guessed from a prompt token's
    cost alone: STALL decode steps of tokens when the chunk rides in the decode pass,
    half that when it is a pass of its own (whose fixed cost the guess does not know)."""
    guesses = []
    for mixed in (False, True):
        pace = StepPace(fallback=256, most=4096, mixed=mixed)
        pace.observe(0, 500, 0.5)  # 1 ms a prompt token, alone
        pace.observe(8, 0, 0.1)
        guesses.append(pace.prefill_tokens(8))
    assert guesses == [int(0.5 * STALL * 100), int(STALL * 100)]
