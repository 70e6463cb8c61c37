"""benchmarks.micro.sampler: figures for every kind of request, and a baseline tree timed beside this one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.micro import sampler

REPO = Path(__file__).resolve().parents[2]


def test_this_tree_against_itself_as_the_baseline(tmp_path, capsys):
    out = tmp_path / "out.json"
    sampler.main(["--rows", "4", "--vocab", "64", "--rounds", "1", "--calls", "1", "--baseline-tree", str(REPO),
                  "--json", str(out)])
    figures = json.loads(out.read_text())["ms_per_call"]
    assert set(figures) == set(sampler.CASES)
    assert all(set(by_tree) == {"baseline", "this tree"} and min(by_tree.values()) > 0 for by_tree in figures.values())
    assert "baseline / this" in capsys.readouterr().out


def test_a_baseline_tree_without_a_sampler_is_named(tmp_path):
    with pytest.raises(SystemExit, match="no engine/sampler.py under"):
        sampler.main(["--rows", "2", "--vocab", "8", "--baseline-tree", str(tmp_path)])
