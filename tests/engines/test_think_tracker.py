"""The reasoning part's state machine, shared by the core's budget and the front end's
usage count (text/thinking.py)."""

from __future__ import annotations

from mlxd.core.types import ThinkSpec
from mlxd.text.thinking import ThinkTracker

START, END = [7], [8]


def _run(tracker: ThinkTracker, tokens: list[int]) -> ThinkTracker:
    for t in tokens:
        tracker.observe(t)
    return tracker


def test_a_part_the_prompt_opened_counts_until_its_end():
    t = _run(ThinkTracker(ThinkSpec(START, END, open=True)), [1, 2, 3, 8, 4, 5])
    assert t.reasoning_tokens == 3 and t.closed and not t.thinking


def test_a_part_the_model_opens_itself():
    t = _run(ThinkTracker(ThinkSpec(START, END)), [1, 7, 2, 3, 8, 4])
    assert t.reasoning_tokens == 2 and t.closed


def test_a_second_start_after_the_part_closed_is_answer():
    t = _run(ThinkTracker(ThinkSpec(START, END, open=True)), [1, 8, 7, 2, 3])
    assert t.reasoning_tokens == 1 and not t.thinking


def test_multi_token_markers():
    t = _run(ThinkTracker(ThinkSpec([5, 6], [8, 9], open=False)), [1, 5, 6, 2, 3, 8, 9, 4])
    assert t.reasoning_tokens == 2 and t.closed


def test_forcing_the_end_when_the_budget_is_spent():
    t = ThinkTracker(ThinkSpec(START, [8, 9], open=True, budget=2))
    assert t.end_ids_to_force(2, 0) is None
    _run(t, [1, 2])
    assert t.end_ids_to_force(2, 0) == 8
    t.observe(8)
    assert t.end_ids_to_force(2, 1) == 9
    t.observe(9)
    assert t.closed and t.end_ids_to_force(2, 0) is None and t.reasoning_tokens == 2
