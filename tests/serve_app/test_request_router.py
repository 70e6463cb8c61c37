"""Unit tests (no Ray cluster) for ``LLMRequestRouter``, driven the way Ray Serve drives it.

Serve (ray/serve/_private/router.py and request_router.py, 2.60) calls, for each request:
  1. ``choose_replicas(candidates, pending_request)`` in a routing task, which goes on to the next
     pending request without yielding to the event loop (nothing in choose/select awaits I/O), so a burst's
     decisions are all made before any of its requests is sent;
  2. ``on_send_request(replica_id)`` when the request's own coroutine resumes and sends it;
  3. ``on_request_routed(pending_request, replica_id, result)`` after the replica accepted it (a round trip);
  4. ``on_request_completed(replica_id, internal_request_id)`` when the call ends.
``handle.broadcast`` (the router's /stats) does 2 and 4 only, on every replica.
The router and the Serve objects (ReplicaID, PendingRequest, RequestMetadata) are the real classes, built
as Serve builds them; a running replica is represented by the two attributes the router reads
(``replica_id`` and ``routing_stats``).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace

import pytest
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve._private.request_router.common import PendingRequest

from inflight.engine.block_hash import block_hashes
from inflight.serve_app import request_router
from inflight.serve_app.messages import GenerateRequest
from inflight.serve_app.request_router import LLMRequestRouter
from tests.engine.helpers import HandClock

pytestmark = pytest.mark.timeout(30)

NOW = 1_000_000.0  # the router's clock here: a report is as fresh when it is read as when it was made


@pytest.fixture(autouse=True)
def frozen_clock(monkeypatch):
    monkeypatch.setattr(request_router, "time", HandClock(NOW))

DEPLOYMENT = DeploymentID(name="LLMReplica", app_name="test")


def replica_id(name: str) -> ReplicaID:
    return ReplicaID(unique_id=name, deployment_id=DEPLOYMENT)


def running_replica(name: str, running: int = 0, max_num_seqs: int = 8):
    stats = {"num_running": running, "num_waiting": 0, "kv_blocks_free": 100, "kv_blocks_total": 100,
             "max_num_seqs": max_num_seqs, "block_size": 4, "time": NOW}
    return SimpleNamespace(replica_id=replica_id(name), routing_stats=stats)


def pending(i: int, prompt: list[int] | None = None) -> PendingRequest:
    metadata = RequestMetadata(request_id=f"req-{i}", internal_request_id=f"internal-{i}", call_method="generate")
    return PendingRequest(args=[GenerateRequest(f"cmpl-{i}", "completion", {}, prompt_token_ids=prompt or [1, 2, 3])],
                          kwargs={},
                          metadata=metadata)


def make_router(policy: str = "least_loaded") -> LLMRequestRouter:
    """As Serve's router builds it (call inside a running event loop)."""
    router = LLMRequestRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN,
                              use_replica_queue_len_cache=True)
    router.initialize_state(policy=policy)
    return router


def send_and_route(router, request, name: str) -> None:
    """Steps 2 and 3: what Serve does once a request's replica has been chosen."""
    router.on_send_request(replica_id(name))
    router.on_request_routed(request, replica_id(name), None)


async def choose(router, candidates, request) -> str:
    ranks = await router.choose_replicas(candidates, request)
    assert all(len(rank) == 1 for rank in ranks) and len(ranks) == len(candidates)
    return ranks[0][0].replica_id.unique_id


def test_choose_replicas_ranks_by_load_and_asks_serve_to_back_off():
    async def scenario():
        router = make_router()
        request = pending(0)
        first = await choose(router, [running_replica("a", running=6), running_replica("b", running=1)], request)
        return first, request.routing_context.should_backoff

    assert asyncio.run(scenario()) == ("b", True)


def test_burst_spreads_before_serve_acknowledges_the_routing():
    """A burst: Serve makes 10 decisions before it sends any of them (step 1 above). The replicas' reports
    are fresh but cannot move within the burst. If the router counts a request only once it is sent
    (``on_send_request``) or routed, all 10 go to the replica that looked lighter at the start; a burst
    must spread instead (b starts one request lighter: 5 or 6 of 10)."""

    async def scenario():
        router = make_router()
        a, b = running_replica("a", running=1), running_replica("b", running=0)
        requests = [pending(i) for i in range(10)]
        picks = [await choose(router, [a, b], r) for r in requests]
        for r, pick in zip(requests, picks):  # now each request's coroutine sends it, and it is accepted
            send_and_route(router, r, pick)
        return Counter(picks)

    picks = asyncio.run(scenario())
    assert picks["b"] in (5, 6) and picks["a"] in (4, 5), f"a burst of 10 landed as {dict(picks)}"


def test_broadcast_calls_do_not_erase_in_flight_counts():
    """/stats is a ``handle.broadcast``: Serve sends it to every replica (``on_send_request``) and reports
    each completion (``on_request_completed``), without choosing or routing it. Real requests' counts stay."""

    async def scenario():
        router = make_router()
        stale = {"time": NOW - 60}  # no fresh report: only the in-flight counts decide
        a = SimpleNamespace(replica_id=replica_id("a"), routing_stats=stale)
        b = SimpleNamespace(replica_id=replica_id("b"), routing_stats=stale)
        for i, name in enumerate(["a", "a", "a", "b", "b"]):
            send_and_route(router, pending(i), name)
        for k in range(2):  # two /stats calls, each on both replicas
            for name in ("a", "b"):
                router.on_send_request(replica_id(name))
            for name in ("a", "b"):
                router.on_request_completed(replica_id(name), f"broadcast-{k}-{name}")
        return await choose(router, [a, b], pending(99))

    assert asyncio.run(scenario()) == "b", "a has 3 requests in flight, b has 2: b is the lighter one"


def test_rejected_then_rerouted_request_is_counted_once():
    """A replica at max_ongoing_requests rejects: Serve sends (2), gets the rejection, the call completes (4),
    and the request is chosen and sent again. Only the accepted attempt stays in flight."""

    async def scenario():
        router = make_router()
        stale = {"time": NOW - 60}
        a = SimpleNamespace(replica_id=replica_id("a"), routing_stats=stale)
        b = SimpleNamespace(replica_id=replica_id("b"), routing_stats=stale)
        send_and_route(router, pending(0), "b")
        request = pending(1)
        first = await choose(router, [a, b], request)
        assert first == "a"
        router.on_send_request(replica_id("a"))
        router.on_request_completed(replica_id("a"), request.metadata.internal_request_id)  # rejected
        again = await choose(router, [b], request)  # "a" is full: Serve offers only "b"
        send_and_route(router, request, again)
        # b now has 2 in flight, a none: the next request goes to a.
        return await choose(router, [a, b], pending(2))

    assert asyncio.run(scenario()) == "a"


def test_in_flight_returns_to_zero_after_every_request_completes():
    async def scenario():
        router = make_router()
        a, b = running_replica("a"), running_replica("b")
        requests = [pending(i) for i in range(6)]
        picks = []
        for r in requests:
            pick = await choose(router, [a, b], r)
            send_and_route(router, r, pick)
            picks.append(pick)
        for r, pick in zip(requests, picks):
            router.on_request_completed(replica_id(pick), r.metadata.internal_request_id)
        # With nothing in flight and equal reports, a fresh burst of two splits one-one again.
        second = [await choose(router, [a, b], pending(100))]
        send_and_route(router, pending(100), second[0])
        second.append(await choose(router, [a, b], pending(101)))
        return Counter(picks), second

    picks, second = asyncio.run(scenario())
    assert sorted(picks.values()) == [3, 3], picks
    assert sorted(second) == ["a", "b"], second


def test_prefix_affinity_hashes_the_prompt_token_ids_of_the_request():
    """A burst: every decision is made before any request is sent, so the prefix's home is the replica the
    first request was given, and the burst's other prompts still spread by load."""
    system = list(range(100, 132))  # 8 blocks of the replicas' reported block size (4)

    async def scenario():
        router = make_router("prefix_affinity")
        replicas = [running_replica(n) for n in ("r1", "r2", "r3")]
        homes = [await choose(router, replicas, pending(i, prompt=system + [i] * 5)) for i in range(5)]
        spread = [await choose(router, replicas, pending(50 + i, prompt=[1000 + i] * 12)) for i in range(6)]
        # a replica that goes away takes its part of the index with it
        router.update_replicas([r for r in replicas if r.replica_id.unique_id != homes[0]])
        return homes, spread, router.policy.prefix_index.num_matched(homes[0], block_hashes(system, 4))

    homes, spread, after_removal = asyncio.run(scenario())
    assert len(set(homes)) == 1, homes
    assert Counter(spread)[homes[0]] <= 1, spread  # the other prompts went elsewhere: the home is the busiest
    assert set(spread) | set(homes) == {"r1", "r2", "r3"}, spread
    assert after_removal == 0
