"""benchmarks.micro.tensor_parallel: both systems run for real on the toy checkpoint (two ranks: a worker process),
rank 0's collectives are counted as the model makes them, the lockstep costs come back, and bad flags are named."""

from __future__ import annotations

import json

import pytest

from benchmarks.micro import tensor_parallel

pytestmark = pytest.mark.slow  # (rank processes spawn: ~45 s; make test runs them, make test-fast does not)


def test_a_run_measures_both_systems_and_the_cost_of_driving_the_ranks(tmp_path, capsys):
    out = tmp_path / "tp.json"
    tensor_parallel.main(["--model", "bench-random", "--rows", "1,3", "--rounds", "1", "--prompt-len", "8",
                          "--tokens", "8", "--iterations", "5", "--dtype", "float32", "--json", str(out)])
    report = json.loads(out.read_text())
    assert [r["rows"] for r in report["results"]] == [1, 3]
    for result in report["results"]:
        assert result["step_ms_tp1"][0] > 0 and result["step_ms_tp2"][0] > 0
        assert set(result["lockstep_s"]) == {"all_reduce", "gather", "send"}
        assert all(seconds > 0 for seconds in result["lockstep_s"].values())
        # every step (prompt or decode) makes two all-reduces a layer and the embedding's: 4 layers here
        counted = result["collectives_counted_per_step"]
        assert sum(v for k, v in counted.items() if "all_reduce" in k) == pytest.approx(result["all_reduces_per_step"])
        assert result["all_reduces_per_step"] == 9
        # (a share of two timings, which a busy machine can push past 1: only its sign is the code's)
        assert result["overhead_share_of_tp2_step"] > 0
    assert "cost a step" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--rows", "0"], ["--rows", "2,x"], ["--tokens", "3"], ["--rounds", "0"],
                                  ["--dtype", "float16"]])
def test_bad_flags_are_named(argv, capsys):
    with pytest.raises(SystemExit):
        tensor_parallel.main(argv)
    assert "--" in capsys.readouterr().err
