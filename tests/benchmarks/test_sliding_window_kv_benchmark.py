"""benchmarks.micro.sliding_window_kv on a small window: it runs, and what it reports is what the engine held."""

from __future__ import annotations

import json

import pytest

from benchmarks.micro import sliding_window_kv


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_a_small_run_reports_the_kv_held_both_ways(tmp_path, family, capsys):
    out = tmp_path / "kv.json"
    sliding_window_kv.main(["--family", family, "--window", "32", "--windows", "4", "--chunk", "32", "--decode", "2",
                            "--budget-mb", "16", "--slots", "2", "--json", str(out)])
    r = json.loads(out.read_text())
    assert r["window_layers"] == (13 if family == "gemma2" else 22) and r["prompt_tokens"] == 128
    per_block = r["kv_bytes_per_token_layer"] * r["block_size"]
    assert r["prefill_end_whole_bytes"] == r["prefill_end_table_blocks"] * r["layers"] * per_block
    assert r["prefill_end_apart_bytes"] == (r["prefill_end_table_blocks"] * (r["layers"] - r["window_layers"])
                                            + r["prefill_end_window_blocks"] * r["window_layers"]) * per_block
    assert r["prefill_end_window_blocks"] <= (32 + 32) // 16 + 1  # a window and a chunk, against 8 blocks whole
    assert r["prefill_end_table_blocks"] == 8
    assert r["budget_tokens_apart"] > r["budget_tokens_whole"]
    assert "tokens in 16 MB" in capsys.readouterr().out
