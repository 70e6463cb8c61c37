"""benchmarks.offline.speculative, through ``benchmarks.offline.offline --speculative``: every method emits the same tokens (the
run checks each request's length; the oracle's 100% acceptance checks its outputs), and the layer-skip draft."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from benchmarks.common.workloads import build_checkpoint
from benchmarks.offline import offline, speculative


def test_offline_runs_each_method_on_the_copy_workload(tmp_path):
    out = tmp_path / "out.json"
    offline.main(["--model", "bench-random", "--workload", "copy", "--num-requests", "2", "--prompt-lens", "8", "16",
                  "--output-lens", "6", "10", "--max-num-seqs", "1", "--speculative", "none,draft,oracle", "--json", str(out)])
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"continuous", "spec-draft", "spec-oracle"}
    oracle = results["spec-oracle"]
    assert oracle["spec_num_proposed_tokens"] > 0 and oracle["spec_acceptance_rate"] == 1.0
    assert results["spec-draft"]["spec_method"] == "draft"
    with pytest.raises(SystemExit):
        offline.parse_args(["--speculative", "none,magic"])
    with pytest.raises(SystemExit):
        offline.parse_args(["--speculative", "ngram", "--baselines", "hf"])


def test_the_layer_skip_draft_keeps_the_first_layers_and_the_head():
    target = build_checkpoint()
    draft = speculative.build_draft_checkpoint(str(target), num_layers=1)
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 1
    with safe_open(draft / "model.safetensors", "pt") as kept, safe_open(target / "model.safetensors", "pt") as full:
        names = set(kept.keys())
        assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= names
        assert any(n.startswith("model.layers.0.") for n in names)
        assert not any(n.startswith("model.layers.1.") for n in names)
        assert names < set(full.keys())
