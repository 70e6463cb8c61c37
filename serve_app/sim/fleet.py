"""A fleet of simulated replicas behind the router's own replica choice, driven by a trace on a virtual clock.

Events, in time order: a request arrives at the router (``RoutingPolicy.choose`` ranks the replicas from what
each last reported and what the router has in flight on each, as ``serve_app/routing.py`` does for the real
router; over ``max_pending_requests`` in flight it is refused, as the router's 429), reaches its replica's engine
``request_s`` later (the serving path's fixed cost: HTTP, tokenizing, the hop), and a replica's step ends (its
tokens are applied, the next batch scheduled at once). A step takes what the profile's cost model says its shape
costs, plus ``message_s`` for each token it streams out (``ServingCosts``, measured on a server:
``serving_costs.py``), stretched while the engines and serving processes of its machine want more cores than it has
(``machine.py``: ``replicas_per_machine`` replicas share one). Not modelled: the network between nodes, work on the
machine other than the server's, client timeouts and retries, speculative decoding, requests that generate nothing
(the prefill lane).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from inflight.engine.config import EngineConfig
from inflight.engine.request import Request
from inflight.engine.sampling_params import SamplingParams
from inflight.serve_app.messages import GenerateRequest
from inflight.serve_app.routing import RoutingPolicy
from inflight.serve_app.sim.cost_model import StepCostModel
from inflight.serve_app.sim.machine import MachineShare, SharedMachine
from inflight.serve_app.sim.replica import RequestTimes, SimulatedReplica, VirtualClock
from inflight.serve_app.sim.serving_costs import ServingCosts
from inflight.serve_app.sim.trace import TraceRequest

ROUTERS = {"least_loaded": "least_loaded", "prefix": "prefix_affinity", "power_of_two": "power_of_two",
           "round_robin": "round_robin"}
# At equal times: arrivals, then requests reaching their engines, then step ends (whose next batch takes those
# requests), then idle engines waking (so requests that reach an idle engine together share its first batch).
_ARRIVE, _ENGINE, _STEP_DONE, _WAKE = 0, 1, 2, 3


@dataclass
class FleetSetup:
    """What a simulation runs: the engine configuration of every replica and what a step costs on their machine."""

    config: EngineConfig
    num_kv_blocks: int
    max_model_len: int
    costs: StepCostModel
    serving: ServingCosts = field(default_factory=ServingCosts)
    window: tuple[int, int] | None = None  # a sliding-window model's (window, window blocks): block_pool.py
    routing_stats_period_s: float = 0.5
    max_pending_requests: int | None = None
    vocab_size: int | None = None  # the prompts' synthetic token ids stay below it
    machine: MachineShare | None = None  # what a machine's replicas share (None: nothing, a step takes its cost)
    replicas_per_machine: int = 1


@dataclass
class SimulatedRequest:
    index: int
    trace: TraceRequest
    times: RequestTimes
    refused: str | None = None  # why the router or the engine refused it


@dataclass
class FleetResult:
    requests: list[SimulatedRequest]
    replicas: list[SimulatedReplica]
    start: float  # the virtual clock at the trace's time 0
    end: float

    @property
    def num_preemptions(self) -> int:
        return sum(r.scheduler.preemption.num_preemptions for r in self.replicas)


def simulate(trace: Sequence[TraceRequest], setup: FleetSetup, num_replicas: int, router: str = "least_loaded",
             seed: int = 0, progress: Callable[[int], None] | None = None) -> FleetResult:
    """Run ``trace`` (sorted by arrival) through ``num_replicas`` replicas; ``progress`` is called with the number of
    requests that ended since its last call."""
    if num_replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {num_replicas}")
    if setup.replicas_per_machine < 1:
        raise ValueError(f"replicas_per_machine must be >= 1, got {setup.replicas_per_machine}")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {sorted(ROUTERS)}, got {router!r}")
    if any(b.arrival_s < a.arrival_s for a, b in zip(trace, trace[1:])):
        raise ValueError("the trace must be sorted by arrival_s")
    clock = VirtualClock()
    start = clock.now
    replicas = [SimulatedReplica(i, setup.config, setup.num_kv_blocks, setup.window, setup.costs, clock,
                                 setup.serving)
                for i in range(num_replicas)]
    policy = RoutingPolicy(ROUTERS[router], seed=seed)
    prefix_routing = policy.policy == "prefix_affinity"
    in_flight = [0] * num_replicas
    waking = [False] * num_replicas  # an idle replica's wake-up is queued
    serving = setup.serving
    requests = [SimulatedRequest(i, t, RequestTimes()) for i, t in enumerate(trace)]
    params_cache: dict[tuple[int, str | None], SamplingParams] = {}
    events: list[tuple[float, int, int, int]] = []  # (time, kind, sequence, request or replica index)
    sequence = 0
    for request in requests:
        events.append((start + request.trace.arrival_s, _ARRIVE, sequence, request.index))
        sequence += 1
    heapq.heapify(events)
    engine_requests: dict[int, Request] = {}
    replica_ids = [r.replica_id for r in replicas]
    replica_index = {replica_id: i for i, replica_id in enumerate(replica_ids)}
    per_machine = setup.replicas_per_machine
    machines = ([SharedMachine(setup.machine) for _ in range(0, num_replicas, per_machine)]
                if setup.machine is not None else None)
    step_event = [-1] * num_replicas  # the sequence number of each replica's current step-end event

    def schedule_ends(ends: dict[int, float]) -> None:
        nonlocal sequence
        for i, end in ends.items():  # an end that moved supersedes the one queued before (skipped when popped)
            step_event[i] = sequence
            heapq.heappush(events, (end, _STEP_DONE, sequence, i))
            sequence += 1

    def start_step(replica: SimulatedReplica) -> None:
        seconds = replica.start_step()
        if seconds is None:
            return
        if machines is None:
            schedule_ends({replica.index: clock.now + seconds})
        else:
            schedule_ends(machines[replica.index // per_machine].start(replica.index, seconds, clock.now))

    while events:
        now, kind, event, index = heapq.heappop(events)
        if kind == _STEP_DONE and event != step_event[index]:
            continue  # its step's end moved
        clock.now = now
        if kind == _ARRIVE:
            request = requests[index]
            if setup.max_pending_requests is not None and sum(in_flight) >= setup.max_pending_requests:
                request.refused = "router: max_pending_requests in flight (429)"
                _done(progress)
                continue
            trace_request = request.trace
            made = _engine_request(request, setup, params_cache, now)
            if isinstance(made, str):
                request.refused = made
                _done(progress)
                continue
            engine_requests[index] = made
            candidates = [(replica_ids[i], in_flight[i], replicas[i].report(setup.routing_stats_period_s))
                          for i in range(num_replicas)]
            routed = (GenerateRequest(str(index), "completion", {"tenant": trace_request.tenant},
                                      prompt_token_ids=made.prompt_token_ids) if prefix_routing else None)
            chosen = replica_index[policy.choose(candidates, routed, now=now)[0]]
            request.times.replica = chosen
            in_flight[chosen] += 1
            heapq.heappush(events, (now + serving.request_s, _ENGINE, sequence, index))
            sequence += 1
        elif kind == _ENGINE:
            request = requests[index]
            replica = replicas[request.times.replica]
            replica.add(engine_requests.pop(index), request.times)
            if not replica.busy and not waking[replica.index]:
                waking[replica.index] = True
                heapq.heappush(events, (now, _WAKE, sequence, replica.index))
                sequence += 1
        elif kind == _WAKE:
            waking[index] = False
            if not replicas[index].busy:
                start_step(replicas[index])
        else:
            replica = replicas[index]
            if machines is not None:
                schedule_ends(machines[index // per_machine].end(index, now))
            for request_id in replica.finish_step():
                in_flight[index] -= 1
                _done(progress)
            start_step(replica)
    end = max((r.times.finished for r in requests if r.times.finished is not None), default=start)
    return FleetResult(requests, replicas, start, end)


def _engine_request(request: SimulatedRequest, setup: FleetSetup, params_cache: dict, now: float) -> Request | str:
    """The engine's request for a trace line, or why the engine would refuse it (as its 400 says)."""
    trace = request.trace
    if trace.prompt_tokens >= setup.max_model_len:
        return f"engine: prompt of {trace.prompt_tokens} tokens does not fit max_model_len {setup.max_model_len} (400)"
    key = (trace.max_tokens, trace.tenant)
    params = params_cache.get(key)
    if params is None:
        params = params_cache[key] = SamplingParams(max_tokens=trace.max_tokens, temperature=0.0, ignore_eos=True,
                                                    tenant=trace.tenant)
    return Request(str(request.index), trace.token_ids(request.index, setup.vocab_size), params, max_model_len=setup.max_model_len,
                   eos_token_ids=frozenset(), priority=trace.priority, arrival_time=now + setup.serving.request_s)


def _done(progress: Callable[[int], None] | None) -> None:
    if progress is not None:
        progress(1)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (linear interpolation, as numpy's default); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def per_request(result: FleetResult) -> list[dict[str, Any]]:
    """Each request's times in seconds: TTFT, TPOT (time per output token after the first), end to end, and when it
    finished (from the trace's start)."""
    rows = []
    for request in result.requests:
        times, trace = request.times, request.trace
        row: dict[str, Any] = {"index": request.index, "arrival_s": trace.arrival_s,
                               "prompt_tokens": trace.prompt_tokens, "max_tokens": trace.max_tokens}
        if request.refused or times.finished is None:
            row["refused" if request.refused else "unfinished"] = request.refused or True
            rows.append(row)
            continue
        arrival = result.start + trace.arrival_s
        ttft = times.first_token - arrival
        e2e = times.finished - arrival
        tokens = times.num_output_tokens
        row.update(replica=times.replica, output_tokens=tokens, ttft_s=ttft, e2e_s=e2e,
                   tpot_s=(e2e - ttft) / (tokens - 1) if tokens > 1 else None,
                   finish_s=times.finished - result.start)
        rows.append(row)
    return rows
