"""The TTFT predictor's arithmetic on constructed states: known step times and queues -> expected predictions."""

from __future__ import annotations

import pytest

from inflight.engine.ttft_predictor import (
    DECODE_DECAY,
    MAX_STEP_RATIO,
    MIN_OBSERVATIONS,
    TTFTPredictor,
)

DECODE_S, PER_TOKEN_S = 0.003, 1e-4


def fitted(budget: int = 64, slots: int = 4) -> TTFTPredictor:
    """A predictor that has seen steps costing exactly DECODE_S + PER_TOKEN_S x prefill tokens, after a slow
    first step of each kind (the warm-up a real engine's first steps pay)."""
    predictor = TTFTPredictor(budget, slots)
    predictor.observe(1.0, 0)  # first decode-only step: skipped
    predictor.observe(5.0, 64)  # first step with prefill: skipped
    for tokens in [0, 0, 64, 32, 0, 50, 0, 20, 60]:
        predictor.observe(DECODE_S + PER_TOKEN_S * tokens, tokens, 2)
    return predictor


def test_rates_are_measured_without_the_first_step_of_each_kind():
    predictor = fitted()
    assert predictor.ready
    assert predictor.decode_step_s == pytest.approx(DECODE_S)
    assert predictor.per_prefill_token_s == pytest.approx(PER_TOKEN_S)


def test_predictor_is_silent_until_it_has_seen_enough_steps():
    predictor = TTFTPredictor(64, 4)
    for i in range(MIN_OBSERVATIONS - 1):
        predictor.observe(0.01, 10 * (i % 2), 1)
    assert predictor.decode_step_s is not None and predictor.per_prefill_token_s is not None
    assert not predictor.ready
    predictor.observe(0.01, 0, 1)
    assert predictor.ready
    only_prefill = TTFTPredictor(64, 4)
    for _ in range(2 * MIN_OBSERVATIONS):
        only_prefill.observe(0.01, 10, 1)
    assert not only_prefill.ready  # no decode step measured yet


def test_a_stalled_step_moves_the_decode_step_by_at_most_its_clipped_share():
    """Another process took the core for one step (100x the usual): the average moves by 8%, not by 2x."""
    predictor = fitted()
    predictor.observe(100 * DECODE_S, 0)
    bound = DECODE_S * (DECODE_DECAY + (1 - DECODE_DECAY) * MAX_STEP_RATIO)
    assert predictor.decode_step_s == pytest.approx(bound)
    assert predictor.decode_step_s < 1.1 * DECODE_S


def test_a_lasting_slowdown_comes_through():
    predictor = fitted()
    for _ in range(400):
        predictor.observe(5 * DECODE_S, 0)
    assert predictor.decode_step_s == pytest.approx(5 * DECODE_S, rel=0.03)


def test_prefill_cost_weighs_steps_by_their_tokens():
    """A 2-token step 10 ms late (noise) barely moves the cost per token: it weighs 2 tokens, and its extra time
    counts at most 5x the current cost. (As an average of per-step ratios it would have added 0.5 ms per token.)"""
    predictor = fitted()
    for _ in range(20):
        predictor.observe(DECODE_S + PER_TOKEN_S * 500, 500)
    predictor.observe(DECODE_S + PER_TOKEN_S * 2 + 0.010, 2)
    assert predictor.per_prefill_token_s == pytest.approx(PER_TOKEN_S, rel=0.01)


def test_a_free_slot_and_nobody_ahead_costs_the_own_prompt_only():
    # 100 prompt tokens through (64 - 2 decode rows) = 62 per step -> 2 steps, 100 prefill tokens.
    predictor = fitted()
    assert predictor.predict(100, tokens_ahead=0, num_ahead=0, running_remaining=[5, 9]) == pytest.approx(
        2 * DECODE_S + 100 * PER_TOKEN_S)
    # One request ahead, and two slots free for the two of them: no slot wait, but its 30 tokens come first.
    assert predictor.slot_wait_steps(1, [5, 9]) == 0
    assert predictor.predict(100, tokens_ahead=30, num_ahead=1, running_remaining=[5, 9]) == pytest.approx(
        (1 + 2) * DECODE_S + 130 * PER_TOKEN_S)


def test_waiting_for_a_slot_counts_the_running_remainders_and_the_prefill_done_meanwhile():
    predictor = fitted()
    running = [20, 3, 8, 7]  # all 4 slots busy (60 prefill tokens a step next to the 4 decodes)
    # One request ahead: the 2nd running request to end (7 steps) frees ours. The 30 tokens ahead are
    # prefilled during those steps, which cost their tokens too; then our 100 (2 steps).
    assert predictor.slot_wait_steps(1, running) == 7
    assert predictor.predict(100, tokens_ahead=30, num_ahead=1, running_remaining=running) == pytest.approx(
        (7 + 2) * DECODE_S + 130 * PER_TOKEN_S)
    # Five ahead: one round of all four slots (a typical output, 12 steps), then the 2nd to end again.
    assert predictor.slot_wait_steps(5, running, typical_output=12) == 7 + 12
    assert predictor.predict(10, tokens_ahead=30, num_ahead=5, running_remaining=running,
                             typical_output=12) == pytest.approx((7 + 12 + 1) * DECODE_S + 40 * PER_TOKEN_S)
    # Without a typical output a round lasts the longest remainder.
    assert predictor.slot_wait_steps(5, running) == 7 + 20


def test_a_long_prefill_queue_ahead_outlasts_the_slot_wait():
    predictor = fitted()
    # 6000 tokens ahead at 60 a step: 100 steps, longer than the 7-step slot wait; then 1 step for our 10.
    assert predictor.predict(10, tokens_ahead=6000, num_ahead=1, running_remaining=[20, 3, 8, 7]) == pytest.approx(
        (100 + 1) * DECODE_S + 6010 * PER_TOKEN_S)
