"""The ray_llm_* series on Ray's Prometheus export (http://127.0.0.1:8080/metrics) after real traffic."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx
import pytest

from tests.serving.helpers import (
    METRICS_URL,
    MODEL,
    completion_body,
    gather_bounded,
    get_stats,
    metric_family,
    scrape,
    wait_idle,
)

GAUGES = ["ray_llm_kv_cache_usage_ratio", "ray_llm_kv_cache_token_usage_ratio", "ray_llm_num_requests_running",
          "ray_llm_num_requests_waiting", "ray_llm_batch_size", "ray_llm_kv_blocks_live", "ray_llm_kv_blocks_cached",
          "ray_llm_kv_blocks_empty", "ray_llm_kv_cache_underused", "ray_llm_spec_acceptance_rate"]
HISTOGRAMS = ["ray_llm_time_to_first_token_seconds", "ray_llm_time_per_output_token_seconds",
              "ray_llm_e2e_request_latency_seconds", "ray_llm_request_queue_time_seconds",
              "ray_llm_scheduler_step_seconds"]
COUNTERS = ["ray_llm_num_preemptions", "ray_llm_admission_rejections", "ray_llm_request_timeouts",
            "ray_llm_prompt_tokens", "ray_llm_generation_tokens",
            # the demo app speculates (n-gram lookup; tests/serving/apps.py), and its long repetitive prompts match
            "ray_llm_spec_proposed_tokens", "ray_llm_spec_accepted_tokens"]
EXPORT_WAIT_S = 45.0  # Ray exports user metrics every few seconds; first appearance can take ~10 s


def _labels(label_text: str) -> dict[str, str]:
    out = {}
    for part in label_text.strip("{}").split('",'):
        if "=" in part:
            key, value = part.split("=", 1)
            out[key.strip()] = value.strip().strip('"')
    return out


def _app_samples(samples, family: str, app: str = "inflight") -> list[tuple[str, dict, float]]:
    return [(name, _labels(labels), value) for name, values in metric_family(samples, family).items()
            for labels, value in values if _labels(labels).get("application") == app]


def _make_traffic(base: str) -> dict[str, int]:
    """A KV squeeze (preemptions) next to a request that times out, then a burst past the admission bound (429s)."""
    seen: Counter = Counter()

    async def run():
        limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
        async with httpx.AsyncClient(base_url=base, timeout=60.0, limits=limits) as client:
            # First, alone (so deadline admission predicts a quick first token and takes it), a request whose
            # deadline passes while it generates: a 504.
            timeout = asyncio.ensure_future(client.post("/v1/completions", json=completion_body(
                max_tokens=1900, ignore_eos=True, timeout=1.0)))
            # Until the engine has taken it, however long it took to get there (a fixed wait can be too short on a
            # busy machine: the squeeze would be queued ahead of it, and admission would refuse it with a 429).
            while not timeout.done() and not (await client.get("/stats")).json()["replicas"][0]["num_running"]:
                await asyncio.sleep(0.02)
            # Three requests that each grow to ~1500 tokens: 3 x 94 blocks > the 256-block pool -> preemption.
            # Their prompts differ from the first character, so prefix caching cannot share their blocks. Greedy:
            # demo-tiny's greedy output repeats itself, so n-gram speculation has proposals accepted.
            squeeze = [client.post("/v1/completions", json=completion_body(f"{i}" + "a" * 1200, max_tokens=300,
                                                                           ignore_eos=True, temperature=0.0))
                       for i in range(3)]
            *squeezed, timed_out = await gather_bounded(squeeze + [timeout], timeout=60)
            assert [r.status_code for r in squeezed] == [200] * 3, [r.text[:200] for r in squeezed]
            assert timed_out.status_code == 504, timed_out.text
            # Long enough that the burst is still in flight when its last request arrives: at 48 tokens a faster
            # engine finished requests as quickly as the client sent them, and the router's bound was never met.
            burst = [client.post("/v1/completions", json=completion_body(f"burst {i}", max_tokens=200,
                                                                         ignore_eos=True)) for i in range(90)]
            for response in [*squeezed, timed_out, *await gather_bounded(burst, timeout=60)]:
                seen[response.status_code] += 1

    asyncio.run(run())
    return dict(seen)


@pytest.mark.slow
@pytest.mark.timeout(150, func_only=True)
def test_llm_metrics_exported_after_traffic(server):
    preemptions_before = get_stats(server)["replicas"][0]["num_preemptions"]
    statuses = _make_traffic(server)
    assert statuses.get(200, 0) >= 3 and statuses.get(429, 0) >= 1 and statuses.get(504, 0) == 1, statuses
    assert set(statuses) <= {200, 429, 504}, statuses
    stats = wait_idle(server, timeout=15.0)
    assert stats["replicas"][0]["num_preemptions"] > preemptions_before, \
        "the KV squeeze should have preempted (else ray_llm_num_preemptions cannot be checked)"

    deadline = time.monotonic() + EXPORT_WAIT_S
    while True:
        samples = scrape(METRICS_URL)
        missing = [f for f in GAUGES + HISTOGRAMS + COUNTERS if not _app_samples(samples, f)]
        zero_counters = [f for f in COUNTERS if sum(v for _, _, v in _app_samples(samples, f)) <= 0]
        if not missing and not zero_counters:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"after {EXPORT_WAIT_S:.0f}s the export still lacks {missing} and has zero counters "
                        f"{zero_counters}; ray_llm series present: {sorted(n for n in samples if 'ray_llm' in n)}")
        time.sleep(2.0)

    for family in HISTOGRAMS:
        counts = [v for name, _, v in _app_samples(samples, family) if name == family + "_count"]
        assert counts and sum(counts) > 0, family
        buckets = [lab for name, lab, _ in _app_samples(samples, family) if name == family + "_bucket"]
        assert any(lab.get("le") == "+Inf" for lab in buckets), family
    for family in GAUGES:
        for _, labels, value in _app_samples(samples, family):
            assert value >= 0, (family, value)
            if "ratio" in family:
                assert value <= 1.0, (family, value)
    # Serve names the source of every engine-side series.
    for _, labels, _ in _app_samples(samples, "ray_llm_generation_tokens"):
        assert labels.get("deployment") == "LLMReplica" and labels.get("replica"), labels
    # Speculation is counted by method, and verification keeps no more than was proposed.
    proposed, accepted = (sum(v for _, lab, v in _app_samples(samples, f"ray_llm_spec_{kind}_tokens")
                              if lab.get("method") == "ngram") for kind in ("proposed", "accepted"))
    assert 0 < accepted <= proposed, (accepted, proposed)
    # Admission rejections decided by the router are counted by the router.
    routers = [lab for _, lab, v in _app_samples(samples, "ray_llm_admission_rejections") if v > 0]
    assert any(lab.get("deployment") == "Router" for lab in routers), routers
    # A timeout the engine decides is counted once, by the replica, never again by the router.
    timeouts = _app_samples(samples, "ray_llm_request_timeouts")
    assert any(lab.get("deployment") == "LLMReplica" and v >= 1 for _, lab, v in timeouts), timeouts
    assert not any(lab.get("deployment") == "Router" and v > 0 for _, lab, v in timeouts), \
        f"the router counted engine timeouts again: {timeouts}"


def test_stats_endpoint_shape(client):
    stats = client.get("/stats").json()
    assert stats["router"]["max_pending_requests"] == 48
    (replica,) = stats["replicas"]
    assert replica["model"] == MODEL and replica["max_num_seqs"] == 32 and replica["max_model_len"] == 2048
    assert replica["kv_blocks_used"] + replica["kv_blocks_free"] == replica["kv_blocks_total"] == 256
    assert 0 <= replica["kv_blocks_cached"] <= replica["kv_blocks_free"]  # cached blocks are reclaimable
    assert 0 <= replica["prefix_cache_hit_tokens"] <= replica["prefix_cache_query_tokens"]
    assert abs(replica["time"] - time.time()) < 5
    assert replica["spec_method"] == "ngram"
    assert replica["spec_num_accepted_tokens"] <= replica["spec_num_proposed_tokens"]
