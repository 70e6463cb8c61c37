"""The simulator's benchmarks run end to end on small inputs: its own speed, and its error against the engine."""

from __future__ import annotations

import json

from benchmarks.micro import simulator_speed
from benchmarks.offline import simulator_error
from inflight.serve_app.sim.trace import load_trace


def test_the_speed_benchmark_simulates_its_whole_trace(tmp_path):
    out, trace = tmp_path / "speed.json", tmp_path / "trace.jsonl"
    assert simulator_speed.main(["--num-requests", "300", "--replicas", "3", "--json", str(out),
                                 "--write-trace", str(trace)]) == 0
    written = json.loads(out.read_text())
    assert written["summary"]["num_finished"] == 300 and written["summary"]["replicas"] == 3
    assert written["wall_s"] > 0 and len(load_trace(trace)) == 300


def test_the_error_benchmark_compares_measured_and_simulated_runs_of_each_trace(tmp_path):
    out = tmp_path / "error.json"
    assert simulator_error.main(["--model", "bench-random", "--num-requests", "6", "--repeats", "1",
                                 "--quick-profile", "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    runs = {run["run"]: run for run in written["runs"]}
    assert set(runs) == {"all at once #1", "Poisson 60% #1", "all at once, mean of 1", "Poisson 60%, mean of 1"}
    for run in runs.values():
        assert run["measured"]["output_tok_per_s"] > 0 and run["simulated"]["output_tok_per_s"] > 0
        measured, simulated = run["measured"]["mean_e2e_s"], run["simulated"]["mean_e2e_s"]
        assert run["error"]["mean_e2e_s"] == (simulated - measured) / measured
    assert set(written["within_bounds"]) == {"all at once, mean of 1", "Poisson 60%, mean of 1"}
