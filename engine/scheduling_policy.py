"""Who is served first and who may be preempted for whom: fcfs, priority or fair share, and aging.

The scheduler asks three things of it: a request's ``rank`` (smaller is served first, larger preempted first),
whether the queue must be searched by rank at all (``in_arrival_order``), and, when a waiting request does not
fit, which running request it may preempt (``victim_for``). Fair share (``scheduling_policy="fair"``) keeps each
tenant's tokens of service (a virtual token counter, VTC) here; the scheduler charges them as it schedules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inflight.engine.config import EngineConfig

if TYPE_CHECKING:
    from inflight.engine.request import Request

Rank = tuple[bool, float, int]  # SchedulingPolicy.rank's key: smaller is served first


def fresh_rank(priority: int, arrival_order: int, priority_policy: bool) -> Rank:
    """The rank of a request that has not aged (``SchedulingPolicy.rank``): by priority under the priority policy,
    then by arrival. Admission ranks newcomers with it too, away from the scheduler (ttft_predictor.QueueView)."""
    return (True, priority if priority_policy else 0, arrival_order)


class SchedulingPolicy:
    def __init__(self, config: EngineConfig) -> None:
        self.max_queue_wait_s = config.max_queue_wait_s
        self.priority = config.scheduling_policy == "priority"
        self.fair = config.scheduling_policy == "fair"
        # Without priorities, tenants or aging the queue's own (arrival) order is the rank order: nothing to search,
        # and a newcomer never preempts.
        self.in_arrival_order = config.scheduling_policy == "fcfs" and config.max_queue_wait_s is None
        # Fair share: tokens of service each tenant has had, and how many requests each has here (waiting or
        # running). The scheduler adds to ``service`` for every row it schedules.
        self.service: dict[str | None, float] = {}
        self._tenant_requests: dict[str | None, int] = {}

    def join(self, tenant: str | None) -> None:
        """A tenant's request arrives (fair share). A tenant with nothing here starts from the least-served active
        tenant's counter, not below it: idle time is not credit to spend on a burst later (VTC). When nobody has
        anything here, a new busy period starts and every counter starts again from zero."""
        if not self._tenant_requests.get(tenant):
            active = [self.service.get(t, 0.0) for t, n in self._tenant_requests.items() if n]
            if active:
                self.service[tenant] = max(self.service.get(tenant, 0.0), min(active))
            else:
                self.service.clear()
        self._tenant_requests[tenant] = self._tenant_requests.get(tenant, 0) + 1

    def leave(self, tenant: str | None) -> None:
        self._tenant_requests[tenant] -= 1

    def rank(self, request: Request, now: float) -> Rank:
        """Who is served first (smallest) and preempted first (largest).

        First, aged requests, oldest first whatever their priority: a request is aged once it has waited
        ``max_queue_wait_s`` since arrival without ever being scheduled, and it stays aged until it ends
        (so, once in, it is not preempted by the urgent work it jumped). Requests preempted after their
        first admission do not age again: their age would let them preempt in turn, a cascade that costs
        recomputation and makes everyone wait. Then (policy ``priority``) the lower priority value, or (policy
        ``fair``) the tenant that has had the fewest tokens of service; then the earlier arrival."""
        if not request.aged:
            max_wait = self.max_queue_wait_s
            if (max_wait is None or request.metrics.first_scheduled_time is not None
                    or now - request.metrics.arrival_time < max_wait):
                if self.fair:  # the least-served tenant first, then arrival
                    return (True, self.service.get(request.params.tenant, 0.0), request.arrival_order)
                return fresh_rank(request.priority, request.arrival_order, self.priority)
            request.aged = True
        return (False, 0, request.arrival_order)

    def victim_for(self, request: Request, running: list[Request], now: float) -> Request | None:
        """The running request that the waiting ``request`` may preempt to get in, if any: the last-ranked one,
        if ``request`` outranks it by age or priority (not by arrival alone: fcfs never preempts for newcomers).
        Age preempts only requests that arrived after it (that jumped the queue by priority or tenant): an earlier
        arrival frees its blocks by finishing, and preempting it to recompute later only wastes work (under fcfs
        in an overload, every waiting request aged into preempting an older running one)."""
        mine = self.rank(request, now)  # (ages the request if it is due)
        candidates = running
        if request.aged:
            candidates = [r for r in running if r.arrival_order > request.arrival_order]
        if not candidates:
            return None
        victim = max(candidates, key=lambda r: self.rank(r, now))
        theirs = self.rank(victim, now)
        # Under fair share a tenant with nothing running preempts the most-served tenant's newest request (the
        # cheapest to recompute) to get its first slot; once it runs, its share is honoured at admission only
        # (counters move every step: preempting by them would ping-pong).
        if self.fair:
            tenant = request.params.tenant
            starved = mine[1] < theirs[1] and not any(r.params.tenant == tenant for r in running)
            if mine[:1] >= theirs[:1] and not starved:
                return None
        elif mine[:2] >= theirs[:2]:
            return None
        return victim
