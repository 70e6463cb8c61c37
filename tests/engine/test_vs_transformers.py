"""The engine's greedy outputs equal transformers' generate token for token, whatever the batching does."""

from __future__ import annotations

import json

import pytest
import torch

from tests.checkpoints import ARCHITECTURES, hf_greedy, hf_logits
from tests.engine.helpers import generate_ids, greedy, launch_ahead, make_engine, random_prompts

NUM_REQUESTS = 8
# Different lengths so requests end at different steps; one ends right after its prefill.
MAX_TOKENS = [9, 3, 12, 1, 7, 5, 10, 4]


def workload(seed: int = 0):
    prompts = random_prompts(NUM_REQUESTS, 2, 60, seed=seed)
    prompts[0] = prompts[0][:60] + [7] * (60 - len(prompts[0]))  # at least one prompt of 60: 4 chunks of 16
    return prompts, [greedy(m) for m in MAX_TOKENS]


def assert_matches_hf(path, prompts, params, got):
    for i, (prompt, p, tokens) in enumerate(zip(prompts, params, got)):
        want = hf_greedy(path, prompt, p.max_tokens)
        assert tokens == want, f"request {i} (prompt of {len(prompt)} tokens): engine {tokens} != transformers {want}"


# 20 blocks of 4 tokens = 80 token slots: the longest request (60 + 12) fits alone, but three running
# requests do not, so the pool runs out and the newest running request is preempted and recomputed.
PRESSURE = dict(max_num_seqs=3, max_num_batched_tokens=16, block_size=4, num_kv_blocks=20)


# auto: the compiled CPU kernels where a compiler is found; torch: the PyTorch path they fall back to.
@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_matches_transformers_under_pressure(checkpoint, arch, backend):
    path = checkpoint(arch)
    prompts, params = workload()
    engine = make_engine(path, attention_backend=backend, **PRESSURE)
    got = generate_ids(engine, prompts, params)
    assert engine.scheduler.preemption.num_preemptions > 0, "the KV pool no longer forces preemption: shrink num_kv_blocks"
    assert engine.scheduler.preemption.num_recomputed_tokens > 0
    assert [len(t) for t in got] == MAX_TOKENS
    assert_matches_hf(path, prompts, params, got)
    assert engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("pipelined", [False, True], ids=["computed-at-launch", "launched-ahead"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_async_scheduling_matches_transformers(checkpoint, arch, pipelined, monkeypatch):
    """Steps scheduled ahead of their inputs (the forward on the device thread) give the same tokens; also when
    each is launched before the step before it is collected, as on a GPU (``launch_ahead``)."""
    path = checkpoint(arch)
    prompts, params = workload(seed=3)
    engine = make_engine(path, async_scheduling=True, **PRESSURE)
    ahead = launch_ahead(monkeypatch, engine.runner) if pipelined else None
    got = generate_ids(engine, prompts, params)
    assert engine.async_scheduling and engine.scheduler.preemption.num_preemptions > 0
    if pipelined:
        assert ahead, "no step was launched ahead of the one before it"
    assert_matches_hf(path, prompts, params, got)
    assert engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_preempted_kv_swapped_or_recomputed_gives_transformers_tokens(checkpoint, mode):
    """Preemption either copies the victim's KV to host memory and back, or recomputes it: the same tokens."""
    path = checkpoint("llama")
    prompts, params = workload(seed=2)
    engine = make_engine(path, preemption_mode=mode, swap_space_bytes=1 << 22, enable_prefix_caching=False,
                         **PRESSURE)
    got = generate_ids(engine, prompts, params)
    stats = engine.stats()
    assert engine.scheduler.preemption.num_preemptions > 0
    if mode == "swap":
        assert stats["num_swapped_out_bytes"] > 0 and stats["num_swapped_in_bytes"] == stats["num_swapped_out_bytes"]
        assert stats["num_recomputed_tokens"] == 0
    if mode == "recompute":
        assert stats["num_swapped_out_bytes"] == 0 and stats["num_recomputed_tokens"] > 0
    assert_matches_hf(path, prompts, params, got)
    assert stats["kv_blocks_used"] == 0 and engine.scheduler.preemption.swap_pool.num_free == engine.scheduler.preemption.swap_pool.num_blocks


def test_greedy_matches_transformers_static_batching(checkpoint):
    path = checkpoint("llama")
    prompts, params = workload(seed=1)
    engine = make_engine(path, batching="static", max_num_seqs=3, max_num_batched_tokens=16, block_size=4,
                         num_kv_blocks=60)
    got = generate_ids(engine, prompts, params)
    assert_matches_hf(path, prompts, params, got)
    assert engine.stats()["kv_blocks_used"] == 0


def test_sharded_checkpoint_loads_and_matches(checkpoint):
    path = checkpoint("qwen3", seed=3, max_shard_size="20KB")
    index = path / "model.safetensors.index.json"
    assert index.exists()
    shards = set(json.loads(index.read_text())["weight_map"].values())
    assert len(shards) > 1
    prompts, params = workload(seed=2)
    prompts, params = prompts[:4], params[:4]
    engine = make_engine(path, max_num_seqs=4, max_num_batched_tokens=32)
    assert_matches_hf(path, prompts, params, generate_ids(engine, prompts, params))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_dtype(checkpoint, dtype):
    path = checkpoint("llama")
    torch_dtype = getattr(torch, dtype)
    engine = make_engine(path, dtype=dtype)
    assert engine.runner.dtype == torch_dtype
    assert all(p.dtype == torch_dtype for p in engine.runner.model.parameters())
    prompts = random_prompts(6, 3, 30, seed=4)
    got = generate_ids(engine, prompts, greedy(6))
    assert all(len(t) == 6 for t in got)
    # The first token is compared only where transformers' own top-2 margin in this dtype is wide enough
    # that rounding differences (RoPE in float32 here, in half precision there) cannot flip it.
    compared = 0
    for prompt, tokens in zip(prompts, got):
        logits = hf_logits(path, prompt, torch_dtype)[-1]
        top2 = logits.topk(2).values
        if float(top2[0] - top2[1]) > 0.25:
            assert tokens[0] == int(logits.argmax()), f"prompt {prompt}: first token differs from transformers"
            compared += 1
    assert compared >= 2, "too few prompts with a stable first token: change the prompts' seed"
