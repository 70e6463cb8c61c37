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

import time
from collections import defaultdict
from typing import Any, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from inflight.serve_app.messages import ReplicaStats
from inflight.serve_app.routing import RoutingPolicy


class LLMRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, policy: str = "least_loaded", load_cap: float = 1.5, **_: Any) -> None:
        self.policy = RoutingPolicy(policy, load_cap)
        self.in_flight: dict[str, int] = defaultdict(int)
        self._counted_on: dict[str, str] = {}  # internal request id -> replica its in-flight count is on
        self._typed_stats: dict[str, tuple[dict[str, Any], ReplicaStats]] = {}  # by replica: (Serve's, typed)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        candidates = [(rid, self.in_flight[rid], self._stats(rid, r.routing_stats)) for rid, r in by_id.items()]
        request = pending_request.args[0] if pending_request is not None and pending_request.args else None
        ranked = self.policy.choose(candidates, request, time.time())
        if pending_request is not None and ranked:
            self._count(pending_request.metadata.internal_request_id, ranked[0])
        return [[by_id[replica_id]] for replica_id in ranked]

    def _stats(self, replica_id: str, routing_stats: dict[str, Any] | None) -> ReplicaStats | None:
        """A replica's routing stats as Serve keeps them (the dict ``LLMReplica.record_routing_stats`` returned),
        typed once per report rather than once per request."""
        if not routing_stats:
            return None
        cached = self._typed_stats.get(replica_id)
        if cached is None or cached[0] is not routing_stats:
            cached = self._typed_stats[replica_id] = (routing_stats, ReplicaStats.from_dict(routing_stats))
        return cached[1]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        replica_ids = frozenset(r.replica_id.unique_id for r in replicas)
        # A replica that is gone takes its cache with it (a restarted one comes back with a new id).
        self.policy.prefix_index.forget_except(replica_ids)
        for gone in [r for r in self._typed_stats if r not in replica_ids]:
            del self._typed_stats[gone]

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

