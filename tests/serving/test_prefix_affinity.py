"""Prefix affinity through real Ray Serve and HTTP: requests sharing a prefix meet the replica that caches it.

Two replicas, ``routing_policy: prefix_affinity``. The router hashes each prompt's leading blocks with the
engine's own block hashes, so a prompt's shared part is computed once in the whole deployment: every later
request with the same prefix finds it in its replica's prefix cache. The replicas' ``/stats`` counters
show that exactly (hit tokens = later requests x the prefix's full blocks).
"""

from __future__ import annotations

import httpx
import pytest

from tests.serving.apps import DEMO_APP_ARGS, delete_app, deploy_app
from tests.serving.helpers import get_stats, wait_for_stats, wait_idle

APP_NAME = "affinity"
BLOCK_SIZE = 16
ARGS = {
    **DEMO_APP_ARGS,
    "engine_args": {"max_model_len": 2048, "max_num_seqs": 4, "num_threads": 1, "block_size": BLOCK_SIZE},
    "num_replicas": 2,
    "num_cpus_per_replica": 0.5,
    "routing_policy": "prefix_affinity",
    "routing_stats_period_s": 0.2,
    # Tokens through the Serve calls themselves (no stream channel): this app keeps that path tested.
    "stream_channel": False,
}


@pytest.fixture(scope="module")
def affinity(ray_cluster):
    base = deploy_app(ARGS, name=APP_NAME, route_prefix="/" + APP_NAME)
    wait_for_stats(lambda s: len(s["replicas"]) == 2 and all(r["block_size"] for r in s["replicas"]),
                   base_url=base, timeout=30, what="2 replicas reporting")
    yield base
    delete_app(APP_NAME)


def _hits(stats: dict) -> int:
    return sum(r["prefix_cache_hit_tokens"] for r in stats["replicas"])


def _hits_reach(base: str, before: int, wanted: int) -> int:
    """The hit tokens since ``before`` once the replicas' reports show at least ``wanted`` of them. (The router's
    /stats is what the replicas last reported: right after the last answer, an idle report from before it may still
    be the latest, so an idle deployment alone does not mean its counters are current.)"""
    stats = wait_for_stats(lambda s: _hits(s) - before >= wanted, base_url=base, timeout=10,
                           what=f"{wanted} prefix-cache hit tokens")
    return _hits(stats) - before


@pytest.mark.timeout(120, func_only=True)
def test_requests_sharing_a_prefix_meet_its_cache(affinity):
    groups, per_group, prefix_blocks = 4, 4, 4
    before = _hits(get_stats(affinity))
    with httpx.Client(base_url=affinity, timeout=60.0) as client:
        for i in range(per_group):  # interleaved, so plain load balancing would split every group
            for g in range(groups):
                prefix = [7 + (g * 37 + j * 11) % 200 for j in range(prefix_blocks * BLOCK_SIZE)]
                body = {"model": "demo-tiny", "prompt": prefix + [7 + i] * 5, "max_tokens": 2, "temperature": 0}
                response = client.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
    wait_idle(affinity, timeout=30, num_replicas=2)
    expected = groups * (per_group - 1) * prefix_blocks * BLOCK_SIZE
    assert _hits_reach(affinity, before, expected) == expected


@pytest.mark.timeout(120, func_only=True)
def test_text_and_chat_prompts_are_tokenized_by_the_router_the_engine_s_way(affinity):
    """The router tokenizes text (and renders chat templates) to hash the blocks; the replica then uses those
    ids, so the outputs are what the engine gives for the text itself (the shared demo app routes without
    tokenizing)."""
    system = "You are a terse assistant. Reply with one word. " * 3  # 150 characters: 9 full blocks
    before = _hits(get_stats(affinity))
    texts = []
    with httpx.Client(base_url=affinity, timeout=60.0) as client:
        for question in ("first?", "second?", "third?"):
            body = {"model": "demo-tiny", "prompt": system + question, "max_tokens": 4, "temperature": 0}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["text"])
            chat = {"model": "demo-tiny", "max_tokens": 3, "temperature": 0,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
            response = client.post("/v1/chat/completions", json=chat)
            assert response.status_code == 200, response.text
    wait_idle(affinity, timeout=30, num_replicas=2)
    _hits_reach(affinity, before, 2 * 2 * 8 * BLOCK_SIZE)  # each of the 2 later completions and chats
    from inflight.engine import LLM, SamplingParams

    llm = LLM("demo-tiny", max_model_len=512, num_threads=1)
    expected = [o.outputs[0].text for o in llm.generate([system + q for q in ("first?", "second?", "third?")],
                                                        SamplingParams(max_tokens=4, temperature=0))]
    assert texts == expected
