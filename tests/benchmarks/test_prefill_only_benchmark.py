"""The prefill-only workload and its lane-vs-mixed report (benchmarks.offline.prefill_only, benchmarks.offline.offline)."""

from __future__ import annotations

import pytest

from benchmarks.common.engine_run import run_engine
from benchmarks.common.workloads import BenchRequest, build_workload
from benchmarks.offline import offline
from benchmarks.offline.prefill_only import lane_summary
from tests.engine.helpers import make_engine


def test_the_workload_puts_scoring_and_embeddings_among_the_seed_mix():
    requests = build_workload("prefill-only", 8, seed=1)
    assert [r.kind for r in requests] == ["generate", "score", "generate", "embed"] * 2
    assert all(r.max_tokens == 0 for r in requests if r.kind != "generate")
    assert all(20 <= r.max_tokens <= 200 and 50 <= r.prompt_len <= 800 for r in requests if r.kind == "generate")
    assert all(r.kind == "generate" and r.max_tokens == 1 for r in build_workload("one-token", 4))


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "mixed"])
def test_prefill_only_requests_are_done_at_their_first_output(lane):
    """They generate nothing: their TTFT is their latency; the summary splits them from generation requests."""
    requests = [BenchRequest(list(range(10, 16)), 5), BenchRequest(list(range(20, 40)), 0, "score"),
                BenchRequest(list(range(30, 45)), 0, "embed")]
    engine = make_engine(max_num_seqs=2, prefill_lane=lane)
    run = run_engine(engine, requests)
    assert run.ttfts_s[1:] == run.latencies_s[1:]
    assert engine.stats()["num_prefill_lane_batches"] == (1 if lane else 0)  # both in one lane batch
    summary = lane_summary(run, wall_s=1.0)
    assert (summary["num_generate"], summary["num_prefill_only"]) == (1, 2)
    assert summary["generate_tokens_per_s"] == pytest.approx(5 / run.finished_s[0])
    assert summary["prefill_only_latency_s"]["p50"] <= run.span_s


def test_offline_compares_the_lane_with_mixed_on_this_workload():
    args, requests, arrivals, name = offline.parse_args(["--workload", "prefill-only", "--num-requests", "6",
                                                         "--rate", "4"])
    assert args.systems == ["lane", "mixed"] and name == "prefill-only"
    assert len(arrivals) == 6 and arrivals == sorted(arrivals) and arrivals[-1] > 0
    with pytest.raises(SystemExit):
        offline.parse_args(["--workload", "prefill-only", "--baselines", "hf"])
