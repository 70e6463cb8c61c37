"""The block hashes a router computes are the prefix cache's own keys."""

from __future__ import annotations

import subprocess
import sys

from inflight.engine.block_hash import block_hashes
from inflight.engine.block_pool import KVCacheManager


def test_block_hashes_are_the_prefix_caches_hashes():
    bs = 4
    tokens = list(range(100, 123))  # 5 full blocks and 3 tokens
    kv = KVCacheManager(num_blocks=16, block_size=bs, enable_prefix_caching=True)
    assert kv.allocate("a", len(tokens))
    kv.cache_computed_blocks("a", tokens, len(tokens))
    assert block_hashes(tokens, bs) == kv._block_hashes["a"]
    assert len(block_hashes(tokens, bs)) == 5
    assert block_hashes(tokens, bs, max_blocks=2) == kv._block_hashes["a"][:2]
    # a request with the same first 9 tokens finds the first two blocks cached: their hashes agree
    other = tokens[:9] + [7] * 10
    assert kv.match_prefix("b", other) == 2 * bs
    assert block_hashes(other, bs)[:2] == block_hashes(tokens, bs)[:2]
    assert block_hashes(other, bs)[2] != block_hashes(tokens, bs)[2]


def test_a_block_hash_names_its_whole_prefix():
    bs = 2
    # same second block, different first block: the second hashes differ too
    assert block_hashes([1, 2, 3, 4], bs)[1] != block_hashes([9, 9, 3, 4], bs)[1]
    assert block_hashes([1, 2, 3], bs) == block_hashes([1, 2, 5], bs)
    assert block_hashes([1], bs) == []


def test_block_hashes_are_the_same_in_another_process():
    """Routers and replicas are different processes, each with its own PYTHONHASHSEED."""
    code = "from inflight.engine.block_hash import block_hashes; print(block_hashes(list(range(40)), 16))"
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout.strip() for seed in ("1", "2")}
    assert runs == {str(block_hashes(list(range(40)), 16))}
