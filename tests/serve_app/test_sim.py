"""The fleet simulator's parts: traces, the step cost model and its fit, the fleet's clock, routing and refusals."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from inflight.engine.config import EngineConfig
from inflight.serve_app.sim.cost_model import TERMS, StepCostModel, fit, step_features
from inflight.serve_app.sim.fleet import FleetSetup, per_request, simulate
from inflight.serve_app.sim.machine import MachineShare, SharedMachine
from inflight.serve_app.sim.serving_costs import ServingCosts, per_message_cost, serving_cores_from
from inflight.serve_app.sim.report import summarize
from inflight.serve_app.sim.trace import TraceRequest, at_rate, load_trace, mean_rate, write_trace

COSTS = StepCostModel({"step_s": 0.010, "prefill_token_s": 1e-4, "prefill_row_s": 2e-3, "prefill_pair_s": 1e-7,
                       "decode_row_s": 5e-4, "decode_context_s": 1e-6, "sampled_row_s": 2e-4,
                       "rebuilt_row_s": 1e-4})


def setup(num_kv_blocks: int = 200, **engine_args) -> FleetSetup:
    config = EngineConfig.from_kwargs(model="demo-tiny", block_size=16, num_kv_blocks=num_kv_blocks, **engine_args)
    return FleetSetup(config, num_kv_blocks, 1024, COSTS)


# -- traces ----------------------------------------------------------------------------------------------
def write_lines(tmp_path, *lines: str):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_trace_is_read_sorted_with_its_optional_fields(tmp_path):
    path = write_lines(tmp_path, '{"arrival_s": 2, "prompt_tokens": 10, "max_tokens": 3}',
                       '', '{"prompt_tokens": 8, "output_tokens": 4, "prefix_id": 7, "priority": -1, "tenant": "a"}')
    first, second = load_trace(path)
    assert first == TraceRequest(8, 4, 0.0, prefix_id="7", priority=-1, tenant="a")
    assert second == TraceRequest(10, 3, 2.0)
    assert load_trace(write_trace(tmp_path / "again.jsonl", [first, second])) == [first, second]


@pytest.mark.parametrize("line, said", [
    ("not json", "not JSON"),
    ("[1, 2]", "expected an object"),
    ('{"prompt_tokens": 5}', "max_tokens is missing"),
    ('{"prompt_tokens": 0, "max_tokens": 1}', "prompt_tokens must be an integer >= 1"),
    ('{"prompt_tokens": 5, "max_tokens": 1.5}', "max_tokens must be an integer"),
    ('{"prompt_tokens": 5, "max_tokens": 2, "arrival_s": -1}', "arrival_s must be a number >= 0"),
    ('{"prompt_tokens": 5, "max_tokens": 2, "arrival_s": true}', "arrival_s must be a number"),
    ('{"prompt_tokens": 5, "max_tokens": 2, "colour": "red"}', "unknown field(s) ['colour']"),
    ('{"prompt_tokens": 5, "max_tokens": 2, "output_tokens": 2}', "not both"),
    ('{"prompt_tokens": 5, "max_tokens": 2, "prefix_tokens": 3}', "prefix_tokens needs a prefix_id"),
    ('{"prompt_tokens": 5, "max_tokens": 2, "tenant": 3}', "tenant must be a string"),
])
def test_a_bad_trace_line_is_a_value_error_naming_the_line_and_field(tmp_path, line, said):
    path = write_lines(tmp_path, '{"prompt_tokens": 5, "max_tokens": 2}', line)
    with pytest.raises(ValueError) as error:
        load_trace(path)
    assert said in str(error.value) and ", line 2: " in str(error.value)


def test_an_empty_or_missing_trace_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="holds no requests"):
        load_trace(write_lines(tmp_path, ""))
    with pytest.raises(ValueError, match="--trace: no such file"):
        load_trace(tmp_path / "nowhere.jsonl")


def test_requests_with_one_prefix_id_share_that_many_leading_tokens_and_no_more():
    a = TraceRequest(40, 1, prefix_id="sys", prefix_tokens=24)
    b = TraceRequest(30, 1, prefix_id="sys", prefix_tokens=24)
    alone = TraceRequest(40, 1)
    tokens_a, tokens_b = a.token_ids(0, vocab_size=300), b.token_ids(1, vocab_size=300)
    assert len(tokens_a) == 40 and len(tokens_b) == 30
    assert tokens_a[:24] == tokens_b[:24] and tokens_a[24] != tokens_b[24]
    assert alone.token_ids(0)[:4] != alone.token_ids(1)[:4]
    assert all(0 < t < 300 for t in tokens_a + tokens_b)
    assert TraceRequest(10, 1, prefix_id="x").shared_tokens == 5  # half the prompt by default


def test_a_trace_at_another_rate():
    trace = [TraceRequest(5, 1, t) for t in (0.0, 1.0, 2.0, 4.0)]
    assert mean_rate(trace) == pytest.approx(0.75)
    assert mean_rate(at_rate(trace, 2.0)) == pytest.approx(1.5)
    assert math.isinf(mean_rate([TraceRequest(5, 1), TraceRequest(5, 1)]))


# -- the cost model ----------------------------------------------------------------------------------------
def test_features_count_a_steps_prompt_and_decode_work():
    # a prompt chunk of 4 tokens from position 8, two decodes at positions 9 and 19, the prompt row not sampling
    assert step_features([4, 1, 1], [8, 9, 19], [False, True, True]) == (
        1, 4, 1, 4 * 8 + 10, 2, 10 + 20, 0, 3)
    assert step_features([4, 1], [8, 9], [True, True])[6] == 1  # sampled prompt rows (decodes always sample)
    assert step_features([1, 1], [9, 19], [True, True], rebuilt=False)[-1] == 0  # the persistent batch's step


def mixed_steps(num: int, max_rows: int) -> list[tuple]:
    """Random steps' features: prompt chunks and decodes of random contexts, some sampling, some rebuilt."""
    rng = np.random.default_rng(0)
    features = []
    for _ in range(num):
        rows = int(rng.integers(1, max_rows + 1))
        queries = [int(q) for q in rng.choice([1, 1, 1, 16, 200], size=rows)]
        starts = [int(s) for s in rng.integers(0, 900, size=rows)]
        features.append(step_features(queries, starts, [bool(b) for b in rng.integers(0, 2, size=rows)],
                                      rebuilt=bool(rng.integers(0, 2))))
    return features


def test_the_fit_recovers_the_costs_that_made_the_steps_and_drops_slowed_ones():
    features = mixed_steps(300, 40)
    seconds = [COSTS.predict(f) for f in features]
    seconds[5] *= 4  # a step that waited for a core
    model = fit(features, seconds)
    for term in TERMS:
        assert model.coefficients[term] == pytest.approx(COSTS.coefficients[term], rel=1e-6, abs=1e-12)
    assert model.decode_rows_s == pytest.approx(COSTS.decode_rows_s, rel=1e-6)
    assert model.fit_error["dropped_slow_steps"] == 1
    assert model.fit_error["median_relative_error"] < 1e-9


def test_the_decode_rows_cost_is_a_curve_through_the_measured_batch_sizes():
    # one row much cheaper than the line through the rest, 16 rows dearer than 17 (kernels change with the rows)
    made = StepCostModel({**COSTS.coefficients}, decode_rows_s={1: 0.010, 2: 0.024, 4: 0.030, 16: 0.066, 17: 0.060})
    assert made.step_seconds([1] * 3, [0] * 3, [False] * 3, rebuilt=False) == pytest.approx(0.010 + 0.027 + 3e-6)
    assert made.predict((0, 0, 0, 0, 18, 0, 0, 0)) == pytest.approx(0.054)  # beyond: on along the last two
    assert made.predict((0, 0, 0, 0, 40, 0, 0, 0)) == 0.0  # ... but never below no cost at all
    features = mixed_steps(300, 17) + [step_features([1] * n, [10] * n, [True] * n) for n in range(1, 18)]
    model = fit(features, [made.predict(f) for f in features], knots=[1, 2, 4, 16, 17])
    assert model.decode_rows_s == pytest.approx(made.decode_rows_s, rel=1e-6)
    assert model.fit_error["median_relative_error"] < 1e-9
    line = fit(features, [made.predict(f) for f in features])  # one knot: a line, which cannot follow the rows
    assert line.fit_error["median_relative_error"] > 0.02


def test_a_term_the_steps_cannot_support_comes_out_zero_not_negative():
    features = [step_features([1] * n, [10] * n, [True] * n) for n in range(1, 30)]
    seconds = [0.01 + 0.001 * f[4] - 0.0001 * f[6] for f in features]  # sampling "saves" time: not a real cost
    model = fit(features, seconds)
    assert all(value >= 0 for value in model.coefficients.values())


def test_a_cost_model_refuses_missing_unknown_or_negative_terms():
    with pytest.raises(ValueError, match="missing"):
        StepCostModel({"step_s": 1.0})
    with pytest.raises(ValueError, match=">= 0"):
        replace(COSTS, coefficients={**COSTS.coefficients, "step_s": -1.0})
    with pytest.raises(ValueError, match="unknown"):
        replace(COSTS, coefficients={**COSTS.coefficients, "warp_s": 1.0})
    with pytest.raises(ValueError, match="not both"):
        StepCostModel(COSTS.coefficients | {"decode_row_s": 1.0}, decode_rows_s={1: 1.0})
    with pytest.raises(ValueError, match="keys must be row counts"):
        StepCostModel.from_json(COSTS.to_json() | {"decode_rows_s": {"many": 1.0}})
    read = StepCostModel.from_json(json.loads(json.dumps(COSTS.to_json())))
    assert (read.coefficients, read.decode_rows_s) == (COSTS.coefficients, COSTS.decode_rows_s)


# -- the fleet ------------------------------------------------------------------------------------------
def test_one_request_takes_the_cost_models_time_on_the_virtual_clock():
    serving = ServingCosts(request_s=0.05, message_s=0.001)
    fleet = setup()
    fleet.serving = serving
    fleet.costs = replace(COSTS, coefficients={**COSTS.coefficients, "rebuilt_row_s": 0.0})  # rebuilt steps: below
    result = simulate([TraceRequest(100, 5, 3.0)], fleet, 1)
    row = per_request(result)[0]
    prefill = fleet.costs.step_seconds([100], [0], [True]) + serving.message_s
    decodes = sum(fleet.costs.step_seconds([1], [100 + i], [True]) + serving.message_s for i in range(4))
    # (to the virtual clock's resolution: it counts from VirtualClock.EPOCH)
    assert row["ttft_s"] == pytest.approx(serving.request_s + prefill, abs=1e-8)
    assert row["e2e_s"] == pytest.approx(serving.request_s + prefill + decodes, abs=1e-8)
    assert row["finish_s"] == pytest.approx(3.0 + row["e2e_s"], abs=1e-8)
    assert row["output_tokens"] == 5


def test_each_streamed_token_adds_its_cost_to_a_step():
    fleet = setup()
    trace = [TraceRequest(100, 20)]
    plain = simulate(trace, fleet, 1).replicas[0]
    fleet.serving = ServingCosts(message_s=0.002)
    served = simulate(trace, fleet, 1).replicas[0]
    assert served.num_steps == plain.num_steps == 20
    assert served.busy_s == pytest.approx(plain.busy_s + 0.002 * 20)


def test_steps_on_a_shared_machine_slow_down_while_the_engines_want_more_cores_than_it_has():
    machine = SharedMachine(MachineShare(cores=2, engine_threads=1, serving_cores=0.5))
    assert machine.start(0, 1.0, now=0.0) == {0: 1.0}  # 1.5 cores wanted of 2: full speed
    # a second engine: 2.5 cores wanted, each step at 2 / 2.5 of its speed; the first has 0.5 s of work left
    assert machine.start(1, 0.2, now=0.5) == pytest.approx({0: 0.5 + 0.5 * 1.25, 1: 0.5 + 0.2 * 1.25})
    # the second ends at 0.75: the first did 0.25 / 1.25 = 0.2 s of work meanwhile, its last 0.3 s at full speed
    assert machine.end(1, now=0.75) == pytest.approx({0: 0.75 + 0.3})
    assert machine.end(0, now=1.05) == {}


@pytest.mark.parametrize("replicas_per_machine, stretch", [(1, 1.0), (2, 1.25)])
def test_replicas_sharing_a_machine_take_longer_over_the_same_steps(replicas_per_machine, stretch):
    fleet = setup()
    fleet.machine, fleet.replicas_per_machine = MachineShare(2, 1, 0.5), replicas_per_machine
    result = simulate([TraceRequest(100, 1), TraceRequest(100, 1)], fleet, 2)
    ttfts = [row["ttft_s"] for row in per_request(result)]
    assert sorted(r.times.replica for r in result.requests) == [0, 1]  # one each, computed at once
    assert ttfts == pytest.approx([fleet.costs.step_seconds([100], [0], [True]) * stretch] * 2, abs=1e-8)
    assert [r.busy_s for r in result.replicas] == pytest.approx(ttfts)


def test_the_serving_processes_cores_come_from_how_much_a_step_slows_with_every_engine_busy():
    one_thread = MachineShare(cores=2, engine_threads=1)
    assert serving_cores_from(2.3 / 2, 2, one_thread) == pytest.approx(0.3)
    assert serving_cores_from(0.98, 2, one_thread) == 0.0  # no slowdown: nothing to take
    assert serving_cores_from(1.2, 1, one_thread) == 0.0  # one thread of two cores: a slowdown cannot show
    # engines of two threads on two cores: alone one is already slowed by the serving processes (2.4 / 2)
    filling = MachineShare(cores=2, engine_threads=2, serving_cores=0.4)
    ratio = filling.stretch(2) / filling.stretch(1)
    assert serving_cores_from(ratio, 2, MachineShare(2, 2)) == pytest.approx(0.4)


def test_a_static_batchs_padding_rows_stream_no_message():
    fleet = setup(batching="static", max_num_seqs=4)
    trace = [TraceRequest(50, 2), TraceRequest(50, 10)]  # the first is padding for 8 of the batch's 10 steps
    plain = simulate(trace, fleet, 1).replicas[0]
    fleet.serving = ServingCosts(message_s=0.01)
    served = simulate(trace, fleet, 1).replicas[0]
    assert served.busy_s == pytest.approx(plain.busy_s + 0.01 * (2 + 10))


def test_the_cost_per_message_is_the_least_squares_slope_and_never_negative():
    assert per_message_cost([(1, 0.002), (8, 0.016)]) == pytest.approx(0.002)
    assert per_message_cost([(1, -0.001), (8, -0.004)]) == 0.0


def test_steps_the_persistent_batch_schedules_cost_no_rebuilt_rows():
    only_rebuilding = StepCostModel({term: (1.0 if term == "rebuilt_row_s" else 0.0) for term in TERMS}
                                    | {"decode_row_s": 0.0})
    fleet = setup()
    fleet.costs = only_rebuilding
    trace = [TraceRequest(20, 30), TraceRequest(20, 30)]
    kept = simulate(trace, fleet, 1).replicas[0]
    fleet.config = EngineConfig.from_kwargs(model="demo-tiny", block_size=16, num_kv_blocks=200, persistent_batch=False)
    rebuilt = simulate(trace, fleet, 1).replicas[0]
    assert rebuilt.busy_s == pytest.approx(2 * rebuilt.num_steps)  # every step formed anew: 2 rows each
    assert 2 <= kept.busy_s <= 8  # the first few form the batch, the rest run from it


def test_a_burst_spreads_over_the_replicas_and_prefix_affinity_keeps_a_prefix_together():
    # (one after another: a prefix is cached once a request has computed it, not by one in the same batch)
    trace = [TraceRequest(64, 40, 0.03 * i, prefix_id=str(i % 2), prefix_tokens=48) for i in range(8)]
    spread = simulate(trace, setup(), 2, "least_loaded")
    assert sorted(sum(r.times.replica == i for r in spread.requests) for i in (0, 1)) == [4, 4]
    together = simulate(trace, setup(), 2, "prefix")
    homes = {prefix: {r.times.replica for r in together.requests if r.trace.prefix_id == prefix} for prefix in "01"}
    assert all(len(replicas) == 1 for replicas in homes.values()), homes
    assert homes["0"] != homes["1"]  # two prefixes, two replicas: the second goes to the less loaded one
    assert sum(r.scheduler.num_prefix_hit_tokens for r in together.replicas) > \
        sum(r.scheduler.num_prefix_hit_tokens for r in spread.replicas)


def test_the_router_refuses_past_max_pending_requests_and_the_engine_an_overlong_prompt():
    fleet = setup()
    fleet.max_pending_requests = 3
    trace = [TraceRequest(10, 50, 0.0) for _ in range(5)] + [TraceRequest(2000, 5, 0.0)]
    result = simulate(trace, fleet, 1)
    refused = [r.refused for r in result.requests]
    assert refused[:3] == [None, None, None]
    assert "max_pending_requests" in refused[3] and "max_pending_requests" in refused[4]
    fleet.max_pending_requests = None
    refused = [r.refused for r in simulate(trace, fleet, 1).requests]
    assert refused[:5] == [None] * 5 and "max_model_len 1024 (400)" in refused[5]
    summary = summarize(simulate(trace, fleet, 1))
    assert summary["num_refused"] == 1 and summary["num_finished"] == 5


def test_a_small_kv_pool_preempts_and_the_summary_says_so():
    trace = [TraceRequest(200, 300, 0.0) for _ in range(8)]
    tight = summarize(simulate(trace, setup(num_kv_blocks=60), 1))
    roomy = summarize(simulate(trace, setup(num_kv_blocks=400), 1))
    assert tight["preemptions"] > 0 and roomy["preemptions"] == 0
    assert tight["num_finished"] == roomy["num_finished"] == 8
    assert tight["kv"]["peak_fraction"] > roomy["kv"]["peak_fraction"]
    assert tight["mean_e2e_s"] > roomy["mean_e2e_s"]


def test_static_batching_waits_for_its_batch_and_continuous_does_not():
    trace = [TraceRequest(50, 100 if i == 0 else 5, 0.01 * i) for i in range(4)]
    continuous = per_request(simulate(trace, setup(max_num_seqs=2), 1))
    static = per_request(simulate(trace, setup(max_num_seqs=2, batching="static"), 1))
    # request 2 arrives while a batch of two runs: continuous admits it when request 1 ends, static only when
    # the long request 0 ends too
    assert continuous[2]["ttft_s"] < static[2]["ttft_s"]
