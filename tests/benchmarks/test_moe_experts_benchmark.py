"""benchmarks.micro.moe_experts: a small run measures both systems on a shape, and bad flags are named."""

from __future__ import annotations

import json

import pytest

from benchmarks.micro import moe_experts


@pytest.mark.skipif(not __import__("inflight.kernels.cpu_kernels", fromlist=["x"]).bf16_dot_products(),
                    reason="the MoE kernel needs AVX-512 BF16")
def test_a_run_times_the_kernel_and_the_loop(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(moe_experts.SHAPES, "tiny", (64, 8, 48, 2))
    out = tmp_path / "moe.json"
    moe_experts.main(["--shapes", "tiny", "--rows", "1,5", "--repeats", "2", "--json", str(out)])
    report = json.loads(out.read_text())
    assert [r["rows"] for r in report["results"]] == [1, 5]
    assert all(r["kernel_ms"] > 0 and r["loop_ms"] > 0 for r in report["results"])
    assert "kernel / loop" in capsys.readouterr().out


def test_every_pair_is_routed():
    import torch

    counts = moe_experts.routed(10, 8, 2, torch.Generator().manual_seed(0))
    assert sum(counts) == 20 and len(counts) == 8


@pytest.mark.parametrize("argv", [["--shapes", "gpt-9"], ["--rows", "0"], ["--repeats", "0"]])
def test_bad_flags_are_named(argv, capsys):
    with pytest.raises(SystemExit):
        moe_experts.main(argv)
    assert "--" in capsys.readouterr().err
