"""benchmarks.micro.scheduler: exclusive part times, and a tiny run end to end."""

from __future__ import annotations

import json

import pytest

from benchmarks.micro import scheduler
from benchmarks.micro.scheduler import PartTimer


def test_part_timer_takes_inner_parts_out_of_outer_ones():
    now = [0.0]
    timer = PartTimer(clock=lambda: now[0])

    def inner():
        now[0] += 2.0

    def outer():
        now[0] += 1.0
        wrapped_inner()
        wrapped_inner()
        now[0] += 0.5

    wrapped_inner = timer.wrap("inner", inner)
    timer.wrap("outer", outer)()
    # outer ran 5.5 s in all, 4 of them inside inner
    assert timer.seconds == pytest.approx({"outer": 1.5, "inner": 4.0})


def test_a_small_run_reports_both_loops(tmp_path, capsys):
    out = tmp_path / "out.json"
    scheduler.main(["--model", "demo-tiny", "--num-requests", "8", "--steps", "5", "--repeats", "2",
                    "--decoded-tokens", "3", "--prompt-len", "8", "--device-ms", "2", "--no-settle-heap", "--json", str(out),
                    "--loops", "sync,async,async-collect-first"])
    result = json.loads(out.read_text())
    assert result["us_per_step"] > 0 and len(result["us_per_step_blocks"]) == 2
    assert set(result["breakdown_us_per_step"]) == set(scheduler.PARTS)
    loops = result["loops"]
    assert set(loops) == {"sync", "async", "async-collect-first"}
    for loop in loops.values():
        # the stand-in device was busy most of each step's 2 ms window (it may idle at a block's start and end, and
        # while the host catches up), and the wall time holds it
        assert 1000 < loop["device_us_per_step"] <= loop["wall_us_per_step"]
        blocks = loop["overhead_us_per_step_blocks"]
        assert len(blocks) == 2 and min(blocks) <= loop["overhead_us_per_step"] <= max(blocks)
    assert result["us_per_step"] == loops["sync"]["overhead_us_per_step"]
    assert result["async_overhead_us_per_step"] == loops["async"]["overhead_us_per_step"]
    assert result["report_send_us_per_step"] > 0 and result["report_receive_us_per_step"] > 0
    printed = capsys.readouterr().out
    assert "sync us_per_step" in printed and "async overhead_us_per_step" in printed


def test_bad_block_size_is_named():
    with pytest.raises(SystemExit):
        scheduler.parse_args(["--block-size", "12"])


def test_opcode_counts_repeat_exactly_and_grow_with_the_batch():
    """The same engine state gives the same count (what makes it a noise-free comparison), and on the general
    path a step of more requests runs more opcodes (per row in Python); the persistent batch's step runs far fewer,
    its per-row work being in C loops."""
    counts = {}
    for persistent, num_requests in (("off", 4), ("off", 4), ("off", 16), ("on", 16)):
        args = scheduler.parse_args(["--model", "demo-tiny", "--num-requests", str(num_requests), "--steps", "5",
                                     "--decoded-tokens", "3", "--prompt-len", "8", "--persistent-batch", persistent])
        engine = scheduler.stand_in_engine(args)
        scheduler.start_requests(engine, args, 0)
        counts.setdefault((persistent, num_requests), []).append(scheduler.count_opcodes(engine, 3))
    assert counts["off", 4][0] == counts["off", 4][1] > 0
    assert counts["off", 16][0] > 2 * counts["off", 4][0]
    assert counts["on", 16][0] < counts["off", 16][0] / 2


def test_the_stand_in_picks_its_token_without_an_argmax_over_the_whole_vocabulary():
    import torch

    model = scheduler.StandInModel(8, 49152, 81)  # SmolLM2's vocabulary, its "a"
    logits = model.compute_logits(model(torch.zeros(3, dtype=torch.long), None, None, None))
    assert logits.shape == (3, 82) and logits.argmax(-1).tolist() == [81, 81, 81]
    with pytest.raises(ValueError, match="not in the vocabulary"):
        scheduler.StandInModel(8, 50, 60)
