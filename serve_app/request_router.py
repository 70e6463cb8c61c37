"""Ray Serve ``RequestRouter`` for LLM replicas: applies ``serve_app.routing`` policies inside Serve's handle.

Why a RequestRouter rather than picking replicas by hand in the router deployment: it runs in
the same process as the handle that sends the request, sees the live replica set (replicas that
died or were added by autoscaling), gets each replica's ``record_routing_stats`` report, and keeps
Serve's own backpressure and fallback when a replica is at ``max_ongoing_requests``. Counting
our own in-flight requests per replica (``on_send_request``/``on_request_completed``) keeps
decisions current between reports. (``on_request_routed`` is not the hook for that: Serve calls it
only on its strict-``max_ongoing_requests`` path, while ``on_send_request`` and
``on_request_completed`` pair up on every path.)
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from serve_app.routing import ReplicaLoad, RoutingPolicy, fresh_stats

class LLMRequestRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, policy: str = "least_loaded", load_cap: float = 1.5, **_: Any) -> None:
        self.policy = RoutingPolicy(policy, load_cap)
        self.in_flight: dict[str, int] = defaultdict(int)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        now = time.time()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = [ReplicaLoad(rid, self.in_flight[rid], fresh_stats(r.routing_stats, now)) for rid, r in by_id.items()]
        key = None
        if pending_request is not None and pending_request.args and isinstance(pending_request.args[0], dict):
            key = pending_request.args[0].get("prefix_key")
        return [[by_id[load.replica_id]] for load in self.policy.rank(loads, key)]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self.in_flight[replica_id.unique_id] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.in_flight[replica_id.unique_id] > 0:
            self.in_flight[replica_id.unique_id] -= 1
