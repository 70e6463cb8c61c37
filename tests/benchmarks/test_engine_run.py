"""benchmarks.common.engine_run on demo-tiny: the step records add up to the tokens the engine really computed."""

from __future__ import annotations

import pytest

from benchmarks.common.engine_run import run_engine
from benchmarks.common.workloads import BenchRequest
from tests.engine.helpers import make_engine

# 3 requests of 6-token prompts (demo-tiny's byte ids) asking for 2, 5 and 3 tokens
REQUESTS = [BenchRequest(list(range(10 + i, 16 + i)), n) for i, n in enumerate((2, 5, 3))]


def test_static_run_counts_the_padding_rows_of_its_batches():
    run = run_engine(make_engine(batching="static", max_num_seqs=2), REQUESTS)
    waste = run.waste()
    # batch 1 = requests 0 and 1: request 0 is done after 2 tokens and is padding for 5 - 2 = 3 steps;
    # batch 2 = request 2 alone: no padding.
    assert waste.padding == 3
    assert waste.useful == 3 * 6 + (1 + 4 + 2)  # prompts once, every output token but the last fed back
    assert waste.computed == waste.useful + 3 and waste.wasted == 3
    assert run.summary()["steps"]["padding_tokens"] == 3


def test_continuous_run_wastes_nothing_and_times_add_up_on_the_step_clock():
    run = run_engine(make_engine(max_num_seqs=2), REQUESTS)
    assert run.waste().wasted == 0
    assert sum(s.duration_s for s in run.steps) == pytest.approx(run.span_s)
    assert all(0 < t <= f for t, f in zip(run.ttfts_s, run.latencies_s))
    assert run.tokens_per_s == pytest.approx(10 / run.span_s)


def test_idle_time_between_arrivals_is_skipped_not_slept():
    run = run_engine(make_engine(), REQUESTS[:2], arrivals_s=[0.0, 3600.0])
    assert run.finished_s[1] > 3600.0  # the second request started when it arrived, an hour in
    assert run.latencies_s[1] < 60  # but its latency is only its own steps
    with pytest.raises(ValueError, match="sorted"):
        run_engine(make_engine(), REQUESTS[:2], arrivals_s=[1.0, 0.0])
