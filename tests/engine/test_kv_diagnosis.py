"""The engine applies the seed's KV advice to its own steps: low token-level use while requests wait is
reported with its likely cause, in stats and as a warning."""

from __future__ import annotations

import logging

from tests.engine.helpers import greedy, make_engine, random_prompts, run_engine


def test_too_few_slots_for_the_kv_cache_is_diagnosed(caplog):
    engine = make_engine(max_num_seqs=2, num_kv_blocks=256, block_size=4)  # 1,024 token slots for 2 requests
    for i, prompt in enumerate(random_prompts(40, 5, 15, seed=1)):
        engine.add_request(f"r{i}", prompt, greedy(20))
    with caplog.at_level(logging.WARNING, logger="inflight.engine.llm_engine"):
        run_engine(engine, max_steps=5000)
    stats = engine.stats()
    assert stats["kv_diagnosis_cause"] == "max_num_seqs", stats["kv_diagnosis"]
    assert "max_num_seqs (2) is too small" in stats["kv_diagnosis"]
    assert any("KV cache under-used" in r.message for r in caplog.records)


def test_a_well_sized_engine_has_no_diagnosis():
    engine = make_engine(max_num_seqs=8, num_kv_blocks=64, block_size=4)
    for i, prompt in enumerate(random_prompts(8, 5, 15, seed=2)):
        engine.add_request(f"r{i}", prompt, greedy(20))
    run_engine(engine)
    assert engine.stats()["kv_diagnosis"] is None
