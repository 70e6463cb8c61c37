"""The simulator runs the engine's own scheduling rules: the same trace through the real engine and through the
simulator ends the same requests in the same steps, and a rule changed in the engine changes both alike.

The clock is taken out of the comparison: the simulated step costs exactly 1 s whatever its shape, so virtual
time counts steps, and a request that arrives at step k (added before the engine's k-th step) arrives at k - 0.5 in
the trace (during the step before, so the k-th schedule sees it, as the engine's does). The trace keeps the engine
busy throughout (an idle replica would start a step off the grid), under KV pressure so that preemption,
admission headroom and the policy's order all decide something.
"""

from __future__ import annotations

import pytest

from inflight.engine import LLMEngine, SamplingParams
from inflight.engine.config import EngineConfig
from inflight.engine.scheduler import Scheduler
from inflight.serve_app.sim.cost_model import TERMS, StepCostModel
from inflight.serve_app.sim.fleet import FleetSetup, simulate
from inflight.serve_app.sim.trace import TraceRequest

ONE_SECOND_A_STEP = StepCostModel({term: (1.0 if term == "step_s" else 0.0) for term in TERMS} | {"decode_row_s": 0.0})
# (arrival step, prompt tokens, output tokens, priority): a burst, then arrivals while it runs
TRACE = [(0, 30, 12, 0), (0, 9, 30, 1), (0, 17, 6, 0), (0, 40, 20, 2), (0, 5, 25, 0), (0, 22, 9, 1),
         (3, 12, 14, 0), (4, 33, 7, 0), (6, 8, 18, 2), (9, 26, 11, 0), (11, 14, 16, 1), (15, 6, 22, 0),
         (18, 19, 5, 0), (21, 28, 13, 1)]
# (no aging by the clock: max_queue_wait_s counts seconds, which a 1 s step stretches past any engine step's)
ENGINE_ARGS = dict(device="cpu", block_size=4, num_kv_blocks=28, max_num_seqs=4, max_num_batched_tokens=32,
                   max_model_len=64, kv_headroom_tokens=4, max_queue_wait_s=None)


def trace_requests() -> list[TraceRequest]:
    return [TraceRequest(prompt, output, max(0.0, step - 0.5), prefix_id=str(i % 3) if i % 2 else None,
                         prefix_tokens=8, priority=priority)
            for i, (step, prompt, output, priority) in enumerate(TRACE)]


def engine_finish_steps(engine_args: dict) -> dict[int, int]:
    """Each request's index -> the engine step (0-based) in which it finished; its prompt the trace's tokens."""
    engine = LLMEngine("demo-tiny", **engine_args)
    requests = trace_requests()
    finished: dict[int, int] = {}
    step, next_up = 0, 0
    while len(finished) < len(requests):
        while next_up < len(requests) and TRACE[next_up][0] <= step:
            request = requests[next_up]
            engine.add_request(str(next_up), request.token_ids(next_up, engine.model_config.vocab_size),
                               SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True),
                               priority=request.priority)
            next_up += 1
        assert engine.has_unfinished_requests(), "the trace must keep the engine busy (see the module's note)"
        for output in engine.step():
            if output.finished:
                assert len(output.outputs[0].token_ids) == requests[int(output.request_id)].max_tokens
                finished[int(output.request_id)] = step
        step += 1
    return finished


def simulated_finish_steps(engine_args: dict) -> tuple[dict[int, int], int]:
    engine = LLMEngine("demo-tiny", **engine_args)  # for the facts the engine derives: KV blocks, context
    setup = FleetSetup(EngineConfig.from_kwargs(model="demo-tiny", **engine_args), engine.runner.num_kv_blocks,
                       engine.max_model_len, ONE_SECOND_A_STEP, vocab_size=engine.model_config.vocab_size)
    result = simulate(trace_requests(), setup, num_replicas=1)
    steps = {r.index: round(r.times.finished - result.start) - 1 for r in result.requests}
    return steps, result.num_preemptions


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_simulator_ends_each_request_in_the_step_the_engine_does(policy):
    engine_args = {**ENGINE_ARGS, "scheduling_policy": policy}
    simulated, preemptions = simulated_finish_steps(engine_args)
    assert simulated == engine_finish_steps(engine_args)
    assert preemptions > 0  # the trace does exercise preemption


def test_a_scheduling_rule_changed_in_the_engine_is_seen_by_the_simulator(monkeypatch):
    before, _ = simulated_finish_steps(ENGINE_ARGS)
    # the rule: admission leaves every running request room for kv_headroom_tokens more; now it leaves none
    monkeypatch.setattr(Scheduler, "_headroom_blocks", lambda self, requests: 0)
    after, _ = simulated_finish_steps(ENGINE_ARGS)
    assert after != before  # the change decides something in this trace ...
    assert after == engine_finish_steps(ENGINE_ARGS)  # ... and the simulator follows the engine there
