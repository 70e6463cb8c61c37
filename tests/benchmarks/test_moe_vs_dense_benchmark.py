"""benchmarks.micro.moe_vs_dense on a small shape: both engines decode every row count, and the shapes it builds
compute as much per token."""

from __future__ import annotations

import json

import pytest

from benchmarks.micro import moe_vs_dense
from inflight.engine.models.config import ModelConfig


def test_the_dense_model_has_the_moe_models_active_parameters():
    shape = moe_vs_dense.shapes(2, 256, 16, 32, 4)
    moe, dense = (ModelConfig.from_hf({"vocab_size": 4096, **shape[name]}) for name in ("moe", "dense"))
    assert moe.moe_layers == (0, 1) and not dense.moe_layers
    assert moe.num_experts_per_tok * moe.moe_intermediate_size == dense.intermediate_size
    router = moe.num_layers * moe.num_experts * moe.hidden_size
    inactive = (moe.num_experts - moe.num_experts_per_tok) * 3 * moe.hidden_size * moe.moe_intermediate_size
    assert moe.num_parameters - router - moe.num_layers * inactive == dense.num_parameters


def test_a_small_run_reports_both_models(tmp_path, capsys):
    out = tmp_path / "moe.json"
    moe_vs_dense.main(["--rows", "1,3", "--layers", "1", "--hidden", "128", "--experts", "8", "--expert-width", "32",
                       "--top-k", "2", "--prompt-len", "8", "--tokens", "4", "--repeats", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert [r["rows"] for r in report["results"]] == [1, 3]
    assert all(r["moe_ms"] > 0 and r["dense_ms"] > 0 for r in report["results"])
    assert "MoE / dense" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--top-k", "9", "--experts", "8"], ["--rows", "0"]])
def test_bad_flags_are_named(argv, capsys):
    with pytest.raises(SystemExit):
        moe_vs_dense.main(argv)
    assert "--" in capsys.readouterr().err
