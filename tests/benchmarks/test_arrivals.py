"""Arrival processes and trace files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.common.arrivals import arrival_times, load_trace


def test_gaps_have_mean_one_over_rate_and_burstiness_spreads_them():
    poisson = np.diff(arrival_times(20_000, rate=4.0, seed=1))
    bursty = np.diff(arrival_times(20_000, rate=4.0, burstiness=0.25, seed=1))
    assert poisson.mean() == pytest.approx(0.25, rel=0.05) and bursty.mean() == pytest.approx(0.25, rel=0.05)
    # coefficient of variation of gamma gaps is 1 / sqrt(shape): 1 for Poisson, 2 for shape 0.25
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)


def test_first_arrival_is_at_zero_and_an_infinite_rate_sends_everything_at_once():
    assert arrival_times(3, rate=2.0)[0] == 0.0
    assert arrival_times(3, rate=float("inf")) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rate"):
        arrival_times(3, rate=0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_times(3, rate=1, burstiness=0)


def test_trace_is_read_sorted_by_arrival(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [{"prompt_tokens": 10, "output_tokens": 5, "arrival_s": 2.0}, {"prompt_tokens": 3, "output_tokens": 1}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    entries = load_trace(path)
    assert [(e.prompt_tokens, e.output_tokens, e.arrival_s) for e in entries] == [(3, 1, 0.0), (10, 5, 2.0)]


@pytest.mark.parametrize("line, message", [
    ("not json", "line 1: not JSON"),
    ('{"prompt_tokens": 0, "output_tokens": 5}', "prompt_tokens must be an integer >= 1"),
    ('{"prompt_tokens": 4, "output_tokens": 2.5}', "output_tokens must be an integer >= 1"),
    ('{"prompt_tokens": 4, "output_tokens": 2, "arrival_s": -1}', "arrival_s must be a number >= 0"),
    ("[1, 2]", "expected an object"),
])
def test_bad_trace_lines_are_named(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        load_trace(path)


def test_missing_or_empty_trace(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_trace(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no requests"):
        load_trace(tmp_path / "empty.jsonl")
