"""benchmarks.micro.decode_steps: ours for real on the benchmark checkpoint (few tokens), a row per count, and the flags."""

from __future__ import annotations

import pytest

from benchmarks.micro import decode_steps
from benchmarks.micro.decode_steps import decode_engine
from inflight.engine.models import cpu_packing


def test_steps_are_decode_steps_only_and_counted_per_row_count(capsys, monkeypatch):
    monkeypatch.setattr(cpu_packing, "KERNEL_ROWS", cpu_packing.KERNEL_ROWS)  # --kernel-rows is undone after
    engines = []
    monkeypatch.setattr(decode_steps, "decode_engine", lambda *a: engines.append(decode_engine(*a)) or engines[-1])
    decode_steps.main(["--rows", "1,3", "--prompt-len", "20", "--tokens", "8", "--repeats", "1", "--kernel-rows", "0"])
    linears = [m for m in engines[0].runner.model.modules() if hasattr(m, "kernel_rows")]
    assert linears and all(m.kernel_rows == 0 for m in linears)  # the engine ran oneDNN alone, as asked
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == ["| rows | median decode step (ms) |", "|---|---|"]
    cells = [line.strip("|").split("|") for line in lines[2:]]
    assert [int(rows) for rows, _ in cells] == [1, 3]
    assert all(float(ms) > 0 for _, ms in cells)


def test_a_run_reports_the_steps_after_the_prompts():
    engine = decode_engine(2, 20, 8, 1)
    times = decode_steps.step_times(engine, 2, prompt_len=20, tokens=8)
    # one step prefills both prompts and samples their first tokens, 7 more decode: all but PROMPT_STEPS reported
    assert len(times) == 8 - decode_steps.PROMPT_STEPS
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("argv", [["--rows", "0"], ["--rows", "2,x"], ["--tokens", "0"], ["--kernel-rows", "-1"],
                                  ["--prompt-len", "2000", "--tokens", "100"]])
def test_bad_flags_are_named(argv, capsys):
    with pytest.raises(SystemExit):
        decode_steps.main(argv)
    assert "--" in capsys.readouterr().err
