"""Prefix caching: full KV blocks shared by content hash, invisible in outputs, visible in the metrics.

Outputs are compared with prefix caching off and with transformers, on prompts that share long
prefixes, through chunked prefill and preemption (the cached blocks of a preempted request are
taken back when it returns).
"""

from __future__ import annotations

import random

import pytest

from inflight.engine.block_pool import BlockPool, KVCacheManager
from tests.checkpoints import hf_greedy
from tests.engine.helpers import FIRST_BYTE_ID, generate_ids, greedy, make_engine

SYSTEM = list(range(FIRST_BYTE_ID, FIRST_BYTE_ID + 37))  # a shared "system prompt" of 37 tokens


def shared_prefix_prompts(num: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [SYSTEM + [rng.randrange(FIRST_BYTE_ID, 263) for _ in range(rng.randint(1, 20))] for _ in range(num)]


def run(model, prompts, max_tokens, **args):
    engine = make_engine(str(model), **args)
    checks = []
    listener_steps = []

    def check(record):  # block accounting exact after every step
        engine.scheduler.kv.check_invariants()
        stats = engine.stats()
        assert stats["kv_blocks_used"] + stats["kv_blocks_cached"] + stats["kv_blocks_empty"] == stats["kv_blocks_total"]
        checks.append(stats["kv_blocks_cached"])
        listener_steps.append(record)

    engine.step_listener = check
    ids = generate_ids(engine, prompts, [greedy(n) for n in max_tokens])
    return ids, engine, checks


# gemma3: its sliding layers' KV apart (engine/block_pool.py); a hit needs their last window's blocks cached too
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_shared_prefixes_hit_the_cache_and_outputs_do_not_change(checkpoint, arch):
    path = checkpoint(arch)
    prompts = shared_prefix_prompts(8)
    max_tokens = [6, 2, 9, 4, 7, 3, 5, 8]
    # max_num_seqs=2: later requests arrive after the first ones computed the shared blocks
    args = dict(block_size=4, num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=16)
    cached, engine, cached_blocks = run(path, prompts, max_tokens, **args)
    uncached, plain, _ = run(path, prompts, max_tokens, enable_prefix_caching=False, **args)
    assert cached == uncached
    for prompt, n, tokens in zip(prompts, max_tokens, cached):
        assert tokens == hf_greedy(path, prompt, n)
    stats = engine.stats()
    # every request after the first two finds at least the 9 full blocks of the system prompt
    assert stats["prefix_cache_hit_tokens"] >= 6 * 36
    assert stats["prefix_cache_query_tokens"] == sum(len(p) for p in prompts)
    assert plain.stats()["prefix_cache_hit_tokens"] == 0
    assert max(cached_blocks) > 0 and stats["kv_blocks_used"] == 0 and stats["kv_blocks_cached"] > 0
    assert engine.num_steps < plain.num_steps  # less prefill work


@pytest.mark.parametrize("arch", ["qwen3", "mistral"])  # mistral: every layer slides
def test_caching_is_correct_under_preemption_and_chunking(checkpoint, arch):
    """A pool too small for the batch: requests are preempted and come back to their cached blocks."""
    path = checkpoint(arch)
    prompts = shared_prefix_prompts(6, seed=1)
    max_tokens = [12, 10, 11, 9, 12, 8]
    args = dict(block_size=4, num_kv_blocks=26, max_num_seqs=4, max_num_batched_tokens=12)
    cached, engine, _ = run(path, prompts, max_tokens, **args)
    uncached, _, _ = run(path, prompts, max_tokens, enable_prefix_caching=False, **args)
    assert engine.scheduler.preemption.num_preemptions > 0
    assert engine.stats()["prefix_cache_hit_tokens"] > 0
    assert cached == uncached
    for prompt, n, tokens in zip(prompts, max_tokens, cached):
        assert tokens == hf_greedy(path, prompt, n)


def test_a_full_hit_still_computes_the_last_prompt_token():
    """Two identical prompts of exactly 3 blocks: the second takes 2 blocks and computes its last 4 tokens
    (the last token's logits are needed, and a shared block is never written)."""
    engine = make_engine(block_size=4, max_num_seqs=1)
    prompt = list(range(FIRST_BYTE_ID, FIRST_BYTE_ID + 12))
    first = generate_ids(engine, [prompt], greedy(3))
    records = []
    engine.step_listener = records.append
    second = generate_ids(engine, [prompt], greedy(3))
    assert second == first
    assert records[0].batch.query_lens == [4] and records[0].batch.start_positions == [8]


def test_cached_blocks_are_evicted_least_recently_used_first():
    kv = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    prompts = {name: [base, base + 1, base + 2, base + 3, 99] for name, base in (("a", 10), ("b", 20))}
    for name, tokens in prompts.items():  # each computes 2 full blocks, then ends: 4 cached blocks
        assert kv.allocate(name, len(tokens))
        kv.cache_computed_blocks(name, tokens, len(tokens))
        kv.free(name)
    assert kv.pool.num_cached_idle == 4
    assert kv.match_prefix("a2", prompts["a"]) == 4  # a's blocks are used again: now b's are the oldest
    kv.free("a2")
    assert kv.allocate("c", 8)  # 4 blocks: the 2 empty ones, then b's two (least recently used)
    assert kv.match_prefix("b2", prompts["b"]) == 0
    assert kv.match_prefix("a3", prompts["a"]) == 4
    kv.check_invariants()


def test_a_hash_collision_cannot_hand_out_the_wrong_block():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.register(block, 12345, (None, (1, 2)))
    assert pool.lookup(12345, (None, (1, 2))) == block
    assert pool.lookup(12345, (None, (3, 4))) is None  # same hash, other tokens: a miss


def test_cache_salts_keep_requests_apart():
    """Requests with different salts never share a cached block (one tenant cannot time another's prompt);
    the same salt, or none on both sides, still hits; the tokens do not change."""
    engine = make_engine()

    def hit_tokens(salt, tail):
        before = engine.stats()["prefix_cache_hit_tokens"]
        [tokens] = generate_ids(engine, [SYSTEM + tail], greedy(4, cache_salt=salt))
        return engine.stats()["prefix_cache_hit_tokens"] - before, tokens

    first, want = hit_tokens("tenant:a", [9])
    assert first == 0
    assert hit_tokens("tenant:a", [10])[0] >= 32, "the same salt shares the prefix"
    other, got = hit_tokens("tenant:b", [9])
    assert other == 0 and got == want, "another salt: no hit, same tokens"
    assert hit_tokens(None, [9])[0] == 0, "no salt is a cache of its own"
    assert hit_tokens(None, [11])[0] >= 32


def test_the_router_hashes_a_salted_prompt_as_the_engine_does():
    from inflight.engine.block_hash import block_hashes, salted_root
    from inflight.serve_app.messages import ReplicaStats
    from inflight.serve_app.routing import prompt_block_hashes

    stats = [ReplicaStats(block_size=4)]
    assert prompt_block_hashes(SYSTEM, stats) == block_hashes(SYSTEM, 4, 64)
    salted = prompt_block_hashes(SYSTEM, stats, "tenant:a")
    assert salted == block_hashes(SYSTEM, 4, 64, salted_root("tenant:a"))
    assert not set(salted) & set(prompt_block_hashes(SYSTEM, stats, "tenant:b"))
