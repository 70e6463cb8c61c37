"""Slot timelines from hand-made step records, and the seed's A-E picture from the real engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.offline import timeline
from benchmarks.offline.timeline import Cell, count_states, slot_timeline


def record(running, rows, parents=None):
    """rows: (sequence id, tokens, samples, padding)."""
    ids, lens, samples, padding = (list(x) for x in zip(*rows)) if rows else ([], [], [], [])
    batch = SimpleNamespace(request_ids=ids, query_lens=lens, sample=samples, padding=padding)
    return SimpleNamespace(running_ids=running, batch=batch, parent_ids=parents or {s: s.upper() for s in running})


def test_a_freed_slot_goes_to_the_next_request_and_states_are_named():
    records = [
        record(["a", "b"], [("a", 8, True, False), ("b", 8, True, False)]),   # both prefill
        record(["a", "b"], [("a", 1, True, False), ("b", 1, True, False)]),   # both decode
        record(["b", "c"], [("b", 1, True, False), ("c", 5, False, False)]),  # a left; c's first chunk in slot 0
        record(["b", "c"], [("b", 1, True, False)]),                           # c admitted but not computed
    ]
    grid = slot_timeline(records, num_slots=3)
    assert grid[0] == [Cell("A", "prefill"), Cell("B", "prefill"), Cell(None, "idle")]
    assert grid[1][:2] == [Cell("A", "decode"), Cell("B", "decode")]
    assert grid[2] == [Cell("C", "prefill"), Cell("B", "decode"), Cell(None, "idle")]
    assert grid[3][0] == Cell("C", "held")
    assert count_states(grid) == {"prefill": 3, "decode": 4, "padding": 0, "held": 1, "idle": 4}


def test_static_padding_rows_keep_their_slot_until_the_batch_ends():
    records = [
        record(["a", "b"], [("a", 1, True, False), ("b", 1, True, False)]),
        record(["a", "b"], [("a", 1, False, True), ("b", 1, True, False)]),
    ]
    grid = slot_timeline(records, num_slots=2)
    assert grid[1] == [Cell("A", "padding"), Cell("B", "decode")]
    assert grid[0][0].state == "prefill", "a request's first row is its prefill, even of one token"


def test_more_holders_than_slots_is_an_error():
    with pytest.raises(ValueError, match="slots"):
        slot_timeline([record(["a", "b"], [])], num_slots=1)


def test_seed_picture_from_the_engine(tmp_path, capsys):
    # 5 requests of 10, 4, 16, 6, 8 tokens in 3 slots (the default)
    timeline.main(["--plot", str(tmp_path / "t.png"), "--json", str(tmp_path / "t.json")])
    out = capsys.readouterr().out
    # continuous: B ends after 4 steps and D takes its slot at step 5; A ends after 10, E starts at 11
    assert "slot 1: BbbbDddddd" in out and "slot 0: AaaaaaaaaaEeeeeeee" in out
    # static: the first batch runs 16 steps (C's length), B is padding for 12 of them, then D and E
    assert "slot 1: Bbbb------------Eeeeeeee" in out
    assert (tmp_path / "t.png").stat().st_size > 0


def test_output_lens_must_be_positive_integers():
    with pytest.raises(SystemExit):
        timeline.parse_args(["--output-lens", "3,0"])
    with pytest.raises(SystemExit):
        timeline.parse_args(["--output-lens", "a,b"])
