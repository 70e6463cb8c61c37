"""Ray Serve ``RequestRouter`` for LLM replicas: applies ``serve_app.routing`` policies inside Serve's handle.

Why a RequestRouter rather than picking replicas by hand in the router deployment: it runs in
the same process as the handle that sends the request, sees the live replica set (replicas that
died or were added by autoscaling), gets each replica's ``record_routing_stats`` report, and keeps
Serve's own backpressure and fallback when a replica is at ``max_ongoing_requests``.

Our own in-flight count per replica keeps decisions current between reports. A request counts
against the replica we ranked first *at decision time*: Serve makes all the decisions of a burst
before it sends any of them, so counting at send time (``on_send_request``) would let the whole
burst pick the same replica. If Serve ends up routing it elsewhere (``on_request_routed``) the
count moves; ``on_request_completed`` releases it by request id.
"""

from __future__ import annotations

import importlib
import time
from collections import defaultdict
from typing import Any, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from inflight.serve_app.routing import ReplicaLoad, RoutingPolicy, fresh_stats, request_block_hashes

# Each deployment's live replica ids, (app, deployment) -> ids, as this process's request routers last heard from
# Serve's controller: the router deployment sends requests down replicas' own connections only while those cover
# this set (serve_app.stream_channel), so a new replica is reached through Serve until it is connected.
_LIVE_REPLICAS: dict[tuple[str, str], frozenset[str]] = {}


def live_replicas(app: str, deployment: str) -> frozenset[str] | None:
    """The deployment's replicas Serve routes to now, or None before this process has a request router for it.

    Both sides reach the dict through this module as imported in the process (``importlib``), never through the
    names their classes' code was written with: Serve ships the router deployment's class and this request
    router's class with cloudpickle, which may copy a module-level dict their code names (each class would then
    hold a copy of its own, never shared)."""
    return _LIVE_REPLICAS.get((app, deployment))


def remember_live_replicas(app: str, deployment: str, replica_ids: frozenset[str]) -> None:
    _LIVE_REPLICAS[(app, deployment)] = replica_ids


def this_module():
    """This module as this process imported it (see ``live_replicas``)."""
    return importlib.import_module(__name__)


class LLMRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, policy: str = "least_loaded", load_cap: float = 1.5, **_: Any) -> None:
        self.policy = RoutingPolicy(policy, load_cap)
        self.in_flight: dict[str, int] = defaultdict(int)
        self._counted_on: dict[str, str] = {}  # internal request id -> replica its in-flight count is on

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        now = time.time()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = [ReplicaLoad(rid, self.in_flight[rid], fresh_stats(r.routing_stats, now)) for rid, r in by_id.items()]
        request = pending_request.args[0] if pending_request is not None and pending_request.args else None
        hashes = request_block_hashes(self.policy, request, [r.routing_stats for r in candidate_replicas])
        ranked = self.policy.rank(loads, hashes)
        if pending_request is not None and ranked:
            self._count(pending_request.metadata.internal_request_id, ranked[0].replica_id)
        return [[by_id[load.replica_id]] for load in ranked]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        replica_ids = frozenset(r.replica_id.unique_id for r in replicas)
        deployment = self._deployment_id
        this_module().remember_live_replicas(deployment.app_name, deployment.name, replica_ids)
        # A replica that is gone takes its cache with it (a restarted one comes back with a new id).
        self.policy.prefix_index.forget_except(replica_ids)

    def _count(self, request_id: str, replica_id: str) -> None:
        previous = self._counted_on.get(request_id)
        if previous == replica_id:
            return
        if previous is not None:
            self.in_flight[previous] = max(0, self.in_flight[previous] - 1)
        self._counted_on[request_id] = replica_id
        self.in_flight[replica_id] += 1

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._count(pending_request.metadata.internal_request_id, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        counted_on = self._counted_on.pop(internal_request_id, None)  # broadcasts and pings were never counted
        if counted_on is not None:
            self.in_flight[counted_on] = max(0, self.in_flight[counted_on] - 1)

