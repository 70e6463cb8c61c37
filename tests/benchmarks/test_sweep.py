"""benchmarks.offline.sweep's decisions on hand-made points: median run, who leads, what to recommend."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.common.workloads import BenchRequest
from benchmarks.offline import sweep
from benchmarks.offline.sweep import Point


def point(mode, param, tok_s, p90, failed=0):
    latency = {"mean": p90, "p50": p90, "p90": p90, "p99": p90}
    return Point(mode, param, tok_s, latency, latency, peak_running=3, num_failed=failed)


def args(**overrides):
    values = dict(over="rate", values=[1.0, 2.0, 4.0], latency="p90", latency_slo_s=None, static_batch_size=8,
                  max_num_seqs=64)
    values.update(overrides)
    return SimpleNamespace(**values)


def test_median_point_is_one_real_run_in_the_middle():
    runs = [point("static", 1, 100, 9.0), point("static", 1, 110, 1.0), point("static", 1, 105, 2.0)]
    assert sweep.median_point(runs, args()).latency("p90") == 2.0  # rate sweep: by latency
    assert sweep.median_point(runs, args(over="max-num-seqs")).tokens_per_s == 105  # else by throughput


def test_rate_sweep_compares_latency_and_describes_the_static_range():
    points = {"static": [point("static", 1, 100, 1.0), point("static", 2, 200, 1.5), point("static", 4, 300, 6.0)],
              "continuous": [point("continuous", 1, 100, 1.2), point("continuous", 2, 200, 1.7),
                             point("continuous", 4, 390, 2.0)]}
    comparison = sweep.compare(points, args())
    assert comparison.winners == ["static", "static", "continuous"]
    # static leads by 0.2 at 2 req/s and trails by 4.0 at 4: zero at 2 + 2 * 0.2 / 4.2
    assert comparison.crossovers[0].param == pytest.approx(2 + 0.4 / 4.2)
    lines = sweep.describe_comparison(comparison, args())
    assert lines[0].startswith("crossover at rate ~ 2.1 req/s: static leads below, continuous above")
    assert lines[1] == "static batching is better (lower p90 latency) for rate in 1-2.1 req/s"


def test_recommendation_skips_failed_points_and_sizes_the_token_budget():
    points = {"static": [point("static", 1, 100, 1.0), point("static", 2, 500, 1.5)],
              "continuous": [point("continuous", 1, 100, 1.2), point("continuous", 2, 900, 1.7, failed=3)]}
    requests = [BenchRequest([5] * n, 10) for n in (100, 200, 300, 400, 500, 600, 700, 800, 900, 1000)]
    advice = sweep.recommend(points, requests, args(values=[1.0, 2.0]))
    assert (advice["mode"], advice["at"]) == ("static", 2)  # the 900 tok/s point failed requests
    # static's 8 slots + p90 prompt 910 = 918 -> 1024
    assert (advice["max_num_seqs"], advice["max_num_batched_tokens"]) == (8, 1024)
    assert sweep.recommend(points, requests, args(values=[1.0, 2.0], latency_slo_s=0.5)) is None


def test_bad_sweep_values_are_named(capsys):
    for argv in (["--values", "4,2"], ["--values", "3"], ["--over", "max-num-seqs", "--values", "1.5,3"],
                 ["--serving", "static=http://a"]):
        with pytest.raises(SystemExit):
            sweep.parse_args(argv)
        err = capsys.readouterr().err
        assert "--values" in err or "--serving" in err
