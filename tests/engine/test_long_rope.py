"""Phi-3's LongRoPE (the 128k models): greedy tokens and logprobs equal transformers' for prompts shorter than the
original length that generate past it, and prompts longer than it, through chunked prefill, preemption, the prefill
lane and the prefix cache (which keeps a long prompt's blocks apart: they are rotated otherwise).
"""

from __future__ import annotations

import math

import pytest
import torch

from inflight.engine.models.config import ModelConfig
from inflight.engine.models.rope import RotaryEmbedding, rope_inv_freq
from tests.checkpoints import hf_config, hf_greedy
from tests.engine.helpers import generate_ids, greedy, make_engine, random_prompts, run_engine
from tests.engine.test_prefill_lane import SCORE, assert_prompt_logprobs_match_hf

ORIGINAL = 32  # the original length: max_position_embeddings 512 is 16 times it


def longrope() -> dict:
    """Phi-3-128k's rope settings at a small scale (a fresh dict each time: transformers' config writes into it)."""
    return dict(original_max_position_embeddings=ORIGINAL, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.3 * i for i in range(8)], "long_factor": [2.0 + 1.5 * i for i in range(8)]})


@pytest.fixture
def phi3_128k(checkpoint):
    return checkpoint("phi3", **longrope())


def test_the_config_reads_longrope_as_transformers_does():
    cfg = ModelConfig.from_hf({**hf_config("phi3", **longrope()).to_dict(), "architectures": ["Phi3ForCausalLM"]})
    assert cfg.long_rope_length == ORIGINAL
    assert cfg.rope_scaling["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(16) / math.log(ORIGINAL)))
    rotary = RotaryEmbedding(cfg.head_dim, 64, cfg.rope_theta, cfg.rope_scaling)
    short = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    long = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, long=True)
    factor = cfg.rope_scaling["attention_factor"]
    torch.testing.assert_close(rotary.cos[5], (5 * short).cos() * factor)  # a sequence within the original length
    torch.testing.assert_close(rotary.cos[64 + 5], (5 * long).cos() * factor)  # a longer one's rows: long throughout
    older = {**hf_config("phi3", **longrope()).to_dict(), "architectures": ["Phi3ForCausalLM"]}
    older["rope_parameters"] = {**older["rope_parameters"], "rope_type": "su"}  # (Phi-3's first files)
    assert ModelConfig.from_hf(older).rope_scaling == cfg.rope_scaling
    broken = {**hf_config("phi3").to_dict(), "architectures": ["Phi3ForCausalLM"],
              "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 8}}
    with pytest.raises(ValueError, match="longrope needs short_factor, long_factor"):
        ModelConfig.from_hf(broken)


def test_greedy_tokens_across_and_past_the_original_length(phi3_128k):
    """Short prompts that generate past 32 tokens, long ones (rotated long throughout), in chunks of 16, on 3
    slots of a pool that forces preemption."""
    prompts = [random_prompts(1, n, n, seed=n)[0] for n in (20, 28, 33, 45, 60, 9)]
    params = [greedy(n) for n in (20, 12, 6, 9, 4, 30)]
    engine = make_engine(phi3_128k, max_num_seqs=3, max_num_batched_tokens=16, num_kv_blocks=24)
    got = generate_ids(engine, prompts, params)
    assert engine.scheduler.preemption.num_preemptions > 0
    for prompt, p, tokens in zip(prompts, params, got):
        assert tokens == hf_greedy(phi3_128k, prompt, p.max_tokens), len(prompt)


def test_a_long_sequences_cached_blocks_are_not_a_short_ones(phi3_128k):
    """Prompts sharing their first tokens, short ones (20 and 22 tokens, 5 more each: within the original length) and
    long ones (50): each gets transformers' tokens; a long one finds no block of a short one in the prefix cache
    (they are rotated otherwise), but another long one's, and a short one a short one's."""
    base = random_prompts(1, 50, 50, seed=3)[0]
    prompts = [base[:20], base, base[:48] + [9, 9], base[:16] + [9] * 6]
    engine = make_engine(phi3_128k, max_num_seqs=1)
    got = generate_ids(engine, prompts, greedy(5))
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(phi3_128k, prompt, 5)
    assert engine.stats()["prefix_cache_hit_tokens"] == 0 + 48 + 16  # the second: none of the first's


@pytest.mark.parametrize("mode", ["lane", "mixed"])
def test_a_long_prompts_logprobs(phi3_128k, mode):
    engine = make_engine(phi3_128k, prefill_lane=mode == "lane", max_num_seqs=4, max_num_batched_tokens=16)
    prompt = [1, *random_prompts(1, 50, 50, seed=9)[0]]
    engine.add_request("score", prompt, SCORE)
    assert_prompt_logprobs_match_hf(phi3_128k, prompt, run_engine(engine)["score"].prompt_logprobs)
