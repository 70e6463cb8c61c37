"""``inflight profile`` and ``inflight simulate`` as a user runs them (in-process: no Ray, no server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inflight.__main__ import main
from inflight.serve_app.sim.cost_model import TERMS, StepCostModel
from inflight.serve_app.sim.profile import Profile
from inflight.serve_app.sim.trace import TraceRequest, write_trace

ROOT = Path(__file__).resolve().parents[2]
GPU_CHECK = ROOT / "docs" / "gpu" / "gpu_check-2026-12-04.json"
KNOWN_COSTS = {"step_s": 0.004, "prefill_token_s": 5e-5, "prefill_row_s": 1e-4, "prefill_pair_s": 0.0,
               "decode_row_s": 2e-4, "decode_context_s": 0.0, "sampled_row_s": 0.0, "rebuilt_row_s": 0.0}


def known_profile(tmp_path) -> Path:
    """A profile of made-up costs (what a fleet sizing test can reason about), in the format profile writes."""
    path = tmp_path / "known.json"
    path.write_text(json.dumps({
        "format": 1, "model": "demo-tiny", "source": "made up for a test", "engine_args": {"device": "cpu"},
        "engine": {"num_kv_blocks": 400, "block_size": 16, "max_model_len": 2048, "kv_bytes_per_block": 4096,
                   "kv_window": None, "device": "cpu", "dtype": "float32", "attention_backend": "cpu",
                   "async_scheduling": False, "num_threads": None, "quantization": "auto",
                   "tensor_parallel_size": 1, "vocab_size": 263},
        "cost_model": {"terms": KNOWN_COSTS}, "serving": {"request_s": 0.002, "message_s": 0.0}}))
    return path


def poisson_trace(tmp_path, num: int = 120, rate: float = 20.0) -> Path:
    import random

    rng, t, requests = random.Random(3), 0.0, []
    for i in range(num):
        requests.append(TraceRequest(rng.randint(20, 300), rng.randint(10, 60), round(t, 5)))
        t += rng.expovariate(rate)
    return write_trace(tmp_path / "trace.jsonl", requests)


def test_profile_measures_this_machine_and_simulate_replays_a_trace_on_it(tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert main(["profile", "demo-tiny", "--quick", "--device", "cpu", "--max-num-seqs", "8", "--max-model-len",
                 "512", "--num-kv-blocks", "64", "--out", str(out)]) == 0
    profile = Profile.load(out)
    assert set(profile.cost_model.coefficients) == set(TERMS)
    assert profile.engine["num_kv_blocks"] == 64 and profile.engine["vocab_size"] == 263
    assert profile.engine["device"] == "cpu" and profile.machine["cpu_count"] >= 1
    assert profile.cost_model.predict((1, 0, 0, 0, 1, 17, 1, 1)) > 0  # a decode step costs something
    assert "quick" in profile.source and "wrote" in capsys.readouterr().out

    trace = poisson_trace(tmp_path, num=40)
    result, plots = tmp_path / "out.json", tmp_path / "plots"
    assert main(["simulate", "--profile", str(out), "--trace", str(trace), "--replicas", "2", "--max-num-seqs", "4",
                 "--json", str(result), "--plots", str(plots), "--quiet"]) == 0
    written = json.loads(result.read_text())
    assert written["summary"]["num_finished"] == 40 and written["engine"]["max_num_seqs"] == 4
    assert len(written["requests"]) == 40 and all(r["e2e_s"] >= r["ttft_s"] > 0 for r in written["requests"])
    assert {r["replica"] for r in written["requests"]} == {0, 1}
    assert (plots / "latency_cdf.png").stat().st_size > 0 and (plots / "kv_utilisation.png").stat().st_size > 0
    assert "out tok/s" in capsys.readouterr().out


def test_find_replicas_answers_the_fewest_that_meet_the_slo(tmp_path, capsys):
    out = tmp_path / "sizing.json"
    trace = poisson_trace(tmp_path, rate=80.0)  # one replica's p99 TTFT ~0.5 s, two's ~0.06 s, three's ~0.04 s
    assert main(["simulate", "--profile", str(known_profile(tmp_path)), "--trace", str(trace),
                 "--find-replicas", "--slo", "ttft_p99=0.05,tpot_p99=0.02", "--json", str(out), "--quiet"]) == 0
    written = json.loads(out.read_text())
    needed, tried = written["replicas_needed"], written["tried"]
    assert needed == 3
    assert tried[str(needed)]["p99_ttft_s"] <= 0.05 and tried[str(needed)]["p99_tpot_s"] <= 0.02
    fewer = tried[str(needed - 1)]  # tried, and short of the SLO
    assert fewer["p99_ttft_s"] > 0.05 or fewer["p99_tpot_s"] > 0.02
    assert f"{needed} replicas meet" in capsys.readouterr().out


def test_a_gpu_checks_results_make_a_profile_that_sizes_a_fleet(tmp_path, capsys):
    profile_path = tmp_path / "gpu.json"
    assert main(["profile", "--from-gpu-check", str(GPU_CHECK), "--out", str(profile_path)]) == 0
    profile = Profile.load(profile_path)
    assert profile.engine["device"] == "cuda" and "H200" in profile.machine["gpu"]
    costs = profile.cost_model
    b1, b256 = costs.step_seconds([1], [530], [True]), costs.step_seconds([1] * 256, [530] * 256, [True] * 256)
    assert 0.004 < b1 < 0.008 and 0.012 < b256 < 0.022  # the check measured 5.6 ms and 16.6 ms
    capsys.readouterr()
    trace = poisson_trace(tmp_path, num=400, rate=60.0)
    assert main(["simulate", "--profile", str(profile_path), "--trace", str(trace), "--find-replicas",
                 "--slo", "ttft_p99=0.5,tpot_p99=0.05", "--quiet"]) == 0
    said = capsys.readouterr()
    assert "meet" in said.out and "gpu_check gpu_check-2026-12-04.json" in said.out + said.err


def test_a_gpu_check_that_measured_a_profile_gives_that_profile(tmp_path):
    check = tmp_path / "gpu_check.json"
    check.write_text(json.dumps({"device": "NVIDIA H200", "profile": json.loads(known_profile(tmp_path).read_text())}))
    out = tmp_path / "gpu.json"
    assert main(["profile", "--from-gpu-check", str(check), "--out", str(out)]) == 0
    profile = Profile.load(out)
    known = StepCostModel(KNOWN_COSTS)
    assert (profile.cost_model.coefficients, profile.cost_model.decode_rows_s) == (known.coefficients,
                                                                                   known.decode_rows_s)
    assert profile.source == "gpu_check gpu_check.json: made up for a test"


def test_sweep_draws_both_batching_modes_and_finds_the_crossover(tmp_path, capsys):
    out, plots = tmp_path / "sweep.json", tmp_path / "plots"
    assert main(["simulate", "--profile", str(known_profile(tmp_path)), "--trace", str(poisson_trace(tmp_path, 60)),
                 "--sweep", "rate=2,50", "--max-num-seqs", "8", "--json", str(out), "--plots", str(plots),
                 "--quiet"]) == 0
    written = json.loads(out.read_text())
    assert [p["rate"] for p in written["sweep"]["static"]] == [2.0, 50.0]
    assert written["crossover"]["said"] in capsys.readouterr().out
    assert (plots / "sweep.png").stat().st_size > 0


@pytest.mark.parametrize("flags, said", [
    (["--dtype", "bfloat16"], "--dtype bfloat16: the profile was measured with 'float32'"),
    (["--speculative-config", '{"method": "ngram"}'], "--speculative-config: not simulated"),
    (["--find-replicas"], "--find-replicas needs --slo"),
    (["--find-replicas", "--slo", "ttft_p42=1"], "--slo: 'ttft_p42=1' is not METRIC=SECONDS"),
    (["--find-replicas", "--slo", "ttft_p99=-1"], "ttft_p99 must be > 0"),
    (["--slo", "ttft_p99=1"], "--slo is for --find-replicas"),
    (["--sweep", "speed=3"], "--sweep: expected rate=R1,R2"),
    (["--max-num-seqs", "0"], "max_num_seqs must be an integer >= 1"),
    (["--replicas-per-machine", "2"], "--replicas-per-machine 2: the profile does not say how many cores"),
])
def test_bad_simulate_flags_are_usage_errors_that_name_the_flag(tmp_path, capsys, flags, said):
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "--profile", str(known_profile(tmp_path)), "--trace", str(poisson_trace(tmp_path, 5)),
              *flags])
    assert exit_.value.code == 2
    assert said in capsys.readouterr().err


def test_a_missing_profile_or_an_all_at_once_sweep_is_a_usage_error(tmp_path, capsys):
    at_once = write_trace(tmp_path / "burst.jsonl", [TraceRequest(10, 5)] * 3)
    for argv, said in ((["--profile", str(tmp_path / "none.json"), "--trace", str(at_once)], "--profile: no such file"),
                       (["--profile", str(known_profile(tmp_path)), "--trace", str(at_once), "--sweep", "rate=1"],
                        "every request at one time")):
        with pytest.raises(SystemExit):
            main(["simulate", *argv])
        assert said in capsys.readouterr().err
