"""One simulated replica: the engine's own ``Scheduler`` and KV block pool, on a virtual clock.

Nothing here decides who runs: ``make_scheduler`` builds the scheduler the engine builds (continuous or static,
its policy, admission mode, prefix caching, persistent batch), ``schedule()`` forms each batch and ``update()``
applies its tokens, exactly as ``LLMEngine`` calls them in its synchronous loop. What the simulator adds is the
device: a step takes the time the profile's cost model says its shape costs, on a clock that jumps instead of
waiting. Every sampled token is one no request stops on (the trace's ``max_tokens`` is each request's output
length), so each request ends by length, as with ``ignore_eos``.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from inflight.engine.config import EngineConfig
from inflight.engine.request import Request
from inflight.engine.scheduler import make_scheduler
from inflight.engine.scheduler_output import SchedulerOutput
from inflight.serve_app.messages import ReplicaStats
from inflight.serve_app.sim.cost_model import StepCostModel
from inflight.serve_app.sim.serving_costs import ServingCosts

SAMPLED_TOKEN_ID = 1  # what every simulated step samples (requests have no end-of-sequence ids here)


class VirtualClock:
    """The simulation's "now", in seconds; the schedulers read it (``SchedulerState.clock``) for deadlines and
    aging. It starts at ``EPOCH``, not 0: a replica report stamped 0 reads as untimed to the router."""

    EPOCH = 1_000_000.0

    def __init__(self) -> None:
        self.now = self.EPOCH

    def __call__(self) -> float:
        return self.now


@dataclass
class RequestTimes:
    """One request's life on the virtual clock (absolute, as ``VirtualClock``)."""

    replica: int = -1  # the router's choice (fleet.py)
    first_token: float | None = None
    finished: float | None = None
    num_output_tokens: int = 0


class SimulatedReplica:
    def __init__(self, index: int, config: EngineConfig, num_kv_blocks: int, window: tuple[int, int] | None,
                 costs: StepCostModel, clock: VirtualClock, serving: ServingCosts | None = None) -> None:
        self.index = index
        self.replica_id = f"replica-{index}"
        self.config = config
        self.scheduler = make_scheduler(config, num_kv_blocks, window)
        self.scheduler.clock = clock
        self.costs = costs
        self.message_s = (serving or ServingCosts()).message_s
        self.clock = clock
        self.step: SchedulerOutput | None = None  # the batch on the simulated device, if any
        self.times: dict[str, RequestTimes] = {}
        self.num_steps = 0
        self.busy_s = 0.0
        self._step_started = 0.0
        # KV use after each step was scheduled: (time, blocks in use), for the utilisation curve
        self.kv_times, self.kv_used = array("d"), array("l")
        self._stats: ReplicaStats | None = None

    @property
    def busy(self) -> bool:
        return self.step is not None

    def add(self, request: Request, times: RequestTimes) -> None:
        self.times[request.request_id] = times
        self.scheduler.add(request)

    def start_step(self) -> float | None:
        """Schedule the next batch and put it on the device; returns its duration alone on the machine (the fleet
        stretches it while the machine is shared: machine.py), or None when there is nothing to run."""
        scheduler = self.scheduler
        if not scheduler.has_unfinished():
            return None
        batch = scheduler.schedule()
        if batch.is_empty:
            return None
        self.step = batch
        seconds = self.costs.step_seconds(batch.query_lens, batch.start_positions, batch.sample,
                                          scheduler.scheduled_by_persistent_batch() is None)
        if self.message_s:  # in a server: what each streamed token adds (serving_costs.py)
            seconds += self.message_s * sum(batch.sample)  # a message per sampled token (not static padding rows)
        self.num_steps += 1
        self._step_started = self.clock.now
        self.kv_times.append(self.clock.now)
        self.kv_used.append(scheduler.kv.pool.num_used)
        return seconds

    def finish_step(self) -> list[str]:
        """The batch on the device is done (the clock is at its end): its tokens are applied. Returns the ids of the
        requests that finished."""
        batch, self.step = self.step, None
        now = self.clock.now
        self.busy_s += now - self._step_started
        sampled = [SAMPLED_TOKEN_ID if s else None for s in batch.sample]
        finished = []
        times = self.times
        for request in self.scheduler.update(sampled):
            record = times[request.request_id]
            if record.first_token is None:
                record.first_token = now
            if request.is_finished:
                record.finished = now
                record.num_output_tokens = request.num_output_tokens
                finished.append(request.request_id)
        return finished

    def stats(self) -> ReplicaStats:
        """What this replica would report to the router now (``LLMReplica``'s report, the fields routing reads)."""
        scheduler, pool = self.scheduler, self.scheduler.kv.pool
        return ReplicaStats(replica_id=self.replica_id, num_running=len(scheduler.running),
                            num_waiting=len(scheduler.waiting), kv_blocks_used=pool.num_used,
                            kv_blocks_total=pool.num_blocks, kv_blocks_free=pool.num_free,
                            max_num_seqs=self.config.max_num_seqs, block_size=scheduler.kv.block_size,
                            num_preemptions=scheduler.preemption.num_preemptions, time=self.clock.now)

    def report(self, period_s: float) -> ReplicaStats:
        """The latest report the router holds: a new one every ``period_s`` (``routing_stats_period_s``)."""
        if self._stats is None or self.clock.now - self._stats.time >= period_s:
            self._stats = self.stats()
        return self._stats
