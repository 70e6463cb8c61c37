"""The benchmark arithmetic on hand-made traces: each expected value is worked out in the comment beside it."""

from __future__ import annotations

import math

import pytest

from benchmarks.common.metrics import (
    SLO, EngineLimits, OperatingPoint, RequestLatency, StepSample, compare_curves, diagnose_kv, goodput,
    inter_token_latencies, interpolate, padded_static_batch_tokens, percentile, pick_operating_point,
    recommend_token_budget, summarize, summarize_steps, time_per_output_token, useful_computed_tokens,
)


# -- distributions ------------------------------------------------------------------------------------
def test_percentiles_interpolate_linearly_between_order_statistics():
    values = [7, 1, 10, 3, 5, 2, 9, 4, 8, 6]  # 1..10, unsorted
    # rank (n - 1) * p / 100: p50 -> 4.5 (between 5 and 6), p90 -> 8.1, p99 -> 8.91
    assert summarize(values) == pytest.approx({"mean": 5.5, "p50": 5.5, "p90": 9.1, "p99": 9.91})
    assert percentile([4.0], 99) == 4.0


def test_summary_of_nothing_is_nan_not_zero():
    assert all(math.isnan(v) for v in summarize([]).values())


# -- streaming latencies ----------------------------------------------------------------------------------
def test_tpot_spreads_the_time_after_the_first_token_over_the_tokens_after_it():
    assert time_per_output_token(ttft_s=0.5, e2e_s=2.5, num_output_tokens=5) == pytest.approx(0.5)  # 2.0 s / 4
    assert time_per_output_token(ttft_s=0.5, e2e_s=0.5, num_output_tokens=1) is None


def test_inter_token_latencies_are_gaps_between_chunks():
    assert inter_token_latencies([0.1, 0.3, 0.35]) == pytest.approx([0.2, 0.05])
    assert inter_token_latencies([0.1]) == []


# -- goodput --------------------------------------------------------------------------------------------
def test_goodput_counts_only_successful_requests_within_every_limit():
    slo = SLO(ttft_s=0.2, tpot_s=0.05, e2e_s=None)
    requests = [
        RequestLatency(ok=True, ttft_s=0.1, tpot_s=0.04, e2e_s=3.0),   # good
        RequestLatency(ok=True, ttft_s=0.2, tpot_s=None, e2e_s=0.2),   # good: limits are inclusive; 1 token, no TPOT
        RequestLatency(ok=True, ttft_s=0.3, tpot_s=0.01, e2e_s=0.5),   # TTFT too slow
        RequestLatency(ok=True, ttft_s=0.1, tpot_s=0.06, e2e_s=1.0),   # TPOT too slow
        RequestLatency(ok=False),                                       # failed (a 429, say)
    ]
    per_s, share = goodput(requests, slo, duration_s=4.0)
    assert per_s == pytest.approx(2 / 4.0)
    assert share == pytest.approx(2 / 5)


def test_goodput_without_limits_is_the_success_rate():
    requests = [RequestLatency(ok=True, ttft_s=9.0, e2e_s=9.0), RequestLatency(ok=False)]
    assert goodput(requests, SLO(), duration_s=2.0) == pytest.approx((0.5, 0.5))


def test_an_e2e_limit_fails_a_request_that_has_no_e2e():
    assert not SLO(e2e_s=1.0).met_by(ttft_s=0.1, tpot_s=None, e2e_s=None)


# -- padding -----------------------------------------------------------------------------------------------
def test_useful_tokens_feed_every_prompt_token_and_all_but_the_last_output_token():
    # prompts 5 + 3, outputs 3 (2 fed back) and 1 (none fed back)
    assert useful_computed_tokens([5, 3], [3, 1]) == 10


def test_left_padded_static_batches_compute_every_row_to_the_longest_prompt_and_output():
    prompts, outputs = [5, 3, 4], [3, 6, 2]
    # batch 1 (rows 0, 1): 2 rows x (longest prompt 5 + longest output 6 - 1) = 20; batch 2 (row 2): 1 x (4 + 1) = 5
    assert padded_static_batch_tokens(prompts, outputs, batch_size=2) == 25
    # with one request per batch nothing is padded
    assert padded_static_batch_tokens(prompts, outputs, batch_size=1) == useful_computed_tokens(prompts, outputs)
    with pytest.raises(ValueError, match="batch_size"):
        padded_static_batch_tokens(prompts, outputs, batch_size=0)


# -- per-step summaries -------------------------------------------------------------------------------------
LIMITS = EngineLimits(batching="continuous", max_num_seqs=4, max_num_batched_tokens=100, kv_blocks_total=10,
                      block_size=10)


def step(duration_s=0.01, prefill=0, decode=0, padding=0, running=0, waiting=0, blocks=0, tokens=0) -> StepSample:
    return StepSample(duration_s, prefill, decode, padding, running, waiting, blocks, tokens)


def test_step_summary_splits_time_by_kind_and_averages_occupancy_and_kv():
    steps = [
        step(0.30, prefill=50, running=2, blocks=6, tokens=50),             # prefill only
        step(0.20, prefill=20, decode=2, running=3, blocks=8, tokens=72),   # mixed
        step(0.05, decode=2, padding=1, running=3, blocks=8, tokens=74),    # decode with one padding row
    ]
    summary = summarize_steps(steps, LIMITS)
    assert (summary["prefill_s"], summary["mixed_s"], summary["decode_s"]) == pytest.approx((0.30, 0.20, 0.05))
    # active requests 2, 3, 3 - 1 padding = 2 of 4 slots
    assert summary["mean_active_requests"] == pytest.approx(7 / 3)
    assert summary["mean_occupancy"] == pytest.approx((2 / 4 + 3 / 4 + 2 / 4) / 3)
    assert summary["kv_block_utilisation"] == pytest.approx((0.6 + 0.8 + 0.8) / 3)
    assert summary["kv_token_utilisation"] == pytest.approx((50 + 72 + 74) / 100 / 3)
    assert summary["padding_tokens"] == 1
    assert summary["computed_tokens"] == 50 + 22 + 3


# -- KV diagnosis --------------------------------------------------------------------------------------------
def test_no_diagnosis_when_nobody_waits_or_the_cache_is_well_used():
    assert diagnose_kv([step(running=1, blocks=1, tokens=5)], LIMITS) is None
    assert diagnose_kv([step(running=4, waiting=3, blocks=10, tokens=95)], LIMITS) is None


def test_a_short_queue_is_a_burst_not_a_diagnosis():
    burst = [step(decode=4, running=4, waiting=3, blocks=3, tokens=30)]
    quiet = [step(decode=4, running=4, blocks=3, tokens=30)] * 10
    assert diagnose_kv(burst + quiet, LIMITS) is None  # 1 waiting step of 11 is under 10%
    assert diagnose_kv(burst * 2 + quiet, LIMITS).waiting_steps == 2  # 2 of 12 is not


def test_held_but_unfilled_blocks_while_requests_wait_is_fragmentation():
    steps = [step(running=2, waiting=5, blocks=10, tokens=40), step(running=2, waiting=4, blocks=9, tokens=45),
             step(running=1, waiting=0, blocks=2, tokens=5)]  # nobody waits here: not part of the diagnosis
    diagnosis = diagnose_kv(steps, LIMITS)
    assert diagnosis.cause == "fragmentation" and diagnosis.waiting_steps == 2
    assert diagnosis.cause_shares["fragmentation"] == 1.0  # 9 of 10 blocks held counts as full (>= 90%)
    assert diagnosis.token_utilisation == pytest.approx((0.40 + 0.45) / 2)
    assert diagnosis.block_utilisation == pytest.approx((1.0 + 0.9) / 2)
    assert "fragmentation" in diagnosis.message and "45%" in diagnosis.message  # 85 of 190 held token slots


def test_all_slots_taken_while_requests_wait_blames_max_num_seqs():
    steps = [step(decode=4, running=4, waiting=3, blocks=3, tokens=30)] * 3 + [step(prefill=100, running=2,
                                                                                  waiting=3, blocks=3, tokens=30)]
    diagnosis = diagnose_kv(steps, LIMITS)
    assert diagnosis.cause == "max_num_seqs"
    assert diagnosis.cause_shares == pytest.approx({"fragmentation": 0, "max_num_seqs": 0.75, "token_budget": 0.25,
                                                    "static_batch": 0, "other": 0})
    assert "max_num_seqs (4)" in diagnosis.message


def test_a_full_token_budget_while_requests_wait_blames_the_budget():
    diagnosis = diagnose_kv([step(prefill=99, decode=1, running=2, waiting=2, blocks=4, tokens=40)], LIMITS)
    assert diagnosis.cause == "token_budget" and "max_num_batched_tokens (100)" in diagnosis.message


def test_waiting_on_a_running_static_batch_with_room_to_spare_blames_static_batching():
    limits = EngineLimits("static", 8, 100, 10, 10)
    diagnosis = diagnose_kv([step(decode=3, running=3, waiting=2, blocks=4, tokens=30)], limits)
    assert diagnosis.cause == "static_batch" and "admits nobody into a running batch" in diagnosis.message
    # the same step in continuous mode hit no limit at all
    assert diagnose_kv([step(decode=3, running=3, waiting=2, blocks=4, tokens=30)], LIMITS).cause == "other"


def test_static_batching_diagnosis_points_at_continuous_batching():
    limits = EngineLimits("static", 4, 100, 10, 10)
    diagnosis = diagnose_kv([step(decode=4, running=4, waiting=1, blocks=5, tokens=30)], limits)
    assert diagnosis.cause == "max_num_seqs" and "continuous batching" in diagnosis.message


# -- crossovers -------------------------------------------------------------------------------------------
def test_crossover_is_where_the_interpolated_difference_changes_sign():
    rates = [1.0, 2.0, 3.0, 4.0]
    static_p90 = [1.0, 1.5, 3.0, 6.0]
    continuous_p90 = [1.2, 1.6, 2.0, 2.5]
    result = compare_curves(rates, static_p90, continuous_p90, ("static", "continuous"), higher_is_better=False)
    assert result.winners == ["static", "static", "continuous", "continuous"]
    (crossover,) = result.crossovers
    # static leads by 0.1 at rate 2 and trails by 1.0 at rate 3: zero at 2 + 0.1 / 1.1
    assert crossover.param == pytest.approx(2 + 1 / 11)
    assert (crossover.index, crossover.before, crossover.after) == (1, "static", "continuous")
    assert crossover.fraction == pytest.approx(1 / 11)
    assert result.ranges_won_by("static", rates) == [(1.0, pytest.approx(2 + 1 / 11))]
    assert result.ranges_won_by("continuous", rates) == [(pytest.approx(2 + 1 / 11), 4.0)]


def test_a_tie_at_a_sweep_point_places_the_crossover_on_it_and_two_crossovers_are_found():
    params = [1, 2, 3, 4, 5]
    tput_a = [10, 20, 30, 40, 60]
    tput_b = [12, 20, 28, 40, 50]  # b leads, tie, a leads, tie, a leads: one change of lead, at the first tie
    result = compare_curves(params, tput_a, tput_b, ("a", "b"), higher_is_better=True)
    assert result.winners == ["b", "tie", "a", "tie", "a"]
    assert [c.param for c in result.crossovers] == [pytest.approx(2.0)]
    params2 = [1, 2, 3, 4]
    result2 = compare_curves(params2, [1, 3, 3, 1], [2, 2, 2, 2], ("a", "b"), higher_is_better=True)
    assert [(c.before, c.after) for c in result2.crossovers] == [("b", "a"), ("a", "b")]
    assert [c.param for c in result2.crossovers] == pytest.approx([1.5, 3.5])
    assert result2.ranges_won_by("a", params2) == [(pytest.approx(1.5), pytest.approx(3.5))]


def test_no_crossover_when_one_curve_leads_everywhere():
    result = compare_curves([1, 2, 3], [5, 6, 7], [1, 2, 3], ("static", "continuous"), higher_is_better=False)
    assert result.crossovers == [] and set(result.winners) == {"continuous"}
    assert result.ranges_won_by("continuous", [1, 2, 3]) == [(1, 3)]
    assert result.ranges_won_by("static", [1, 2, 3]) == []


def test_curves_must_share_increasing_sweep_values():
    with pytest.raises(ValueError, match="same length"):
        compare_curves([1, 2], [1, 2, 3], [1, 2], ("a", "b"), True)
    with pytest.raises(ValueError, match="increasing"):
        compare_curves([2, 1], [1, 2], [1, 2], ("a", "b"), True)


def test_interpolate_along_a_segment():
    assert interpolate([(0.0, 10.0), (4.0, 30.0)], 0, 0.25) == pytest.approx((1.0, 15.0))


# -- recommendation -------------------------------------------------------------------------------------
def test_operating_point_is_the_lowest_latency_close_to_the_best_throughput_within_the_slo():
    points = [OperatingPoint("static", 8, 500.0, 4.0), OperatingPoint("continuous", 8, 800.0, 3.0),
              OperatingPoint("continuous", 16, 820.0, 2.5), OperatingPoint("continuous", 32, 1000.0, 9.0)]
    # no SLO: 1000 tok/s wins (nothing else within 5% of it)
    assert pick_operating_point(points).param == 32
    # p90 <= 5 s: best throughput 820; 800 is within 5% but slower; 820 at 2.5 s wins
    assert pick_operating_point(points, latency_slo_s=5.0) == points[2]
    assert pick_operating_point(points, latency_slo_s=1.0) is None


def test_token_budget_holds_all_decodes_plus_a_p90_prompt_rounded_up():
    prompts = [100, 200, 300, 400, 500, 600, 700, 800, 900, 1000]  # p90 = 910
    assert recommend_token_budget(prompts, max_num_seqs=64) == 1024  # 974 -> 1024
    assert recommend_token_budget(prompts, max_num_seqs=200) == 1280  # 1110 -> 1280
