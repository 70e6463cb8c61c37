"""Paged KV memory: a fixed pool of blocks, and the block table of each request.

Invariants (checked by ``KVCacheManager.check_invariants`` in tests):
  * used + free = total, and the free list holds no block twice;
  * a block's ref count equals the number of block tables holding it;
  * a free block has ref count 0 and is in no table;
  * no block is in two tables unless shared on purpose (ref count > 1 says so).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass


class BlockPool:
    """Hands out block ids in [0, num_blocks). Ref-counted so blocks can be shared later."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        assert 0 <= count <= len(self._free), "caller must check num_free first"
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            self._ref_counts[block] -= 1
            assert self._ref_counts[block] >= 0, f"block {block} freed twice"
            if self._ref_counts[block] == 0:
                self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]


@dataclass(frozen=True)
class KVCacheStats:
    num_blocks_total: int
    num_blocks_used: int
    num_blocks_free: int
    num_tokens_capacity: int
    num_tokens_used: int  # token slots holding KV of live requests

    @property
    def block_usage(self) -> float:
        return self.num_blocks_used / self.num_blocks_total

    @property
    def token_usage(self) -> float:
        return self.num_tokens_used / self.num_tokens_capacity


class KVCacheManager:
    """Maps each request to the blocks that hold its KV, growing the table as the request grows."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_fit(self, request_id: str, num_tokens: int) -> bool:
        """Whether the request's table could be grown to hold ``num_tokens`` tokens now."""
        have = len(self.block_tables.get(request_id, ()))
        return self.num_blocks_for(num_tokens) - have <= self.pool.num_free

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table to hold ``num_tokens`` tokens. False (and no change) if blocks run out."""
        table = self.block_tables.get(request_id)
        missing = -(-num_tokens // self.block_size) - (len(table) if table is not None else 0)
        if table is not None and missing <= 0:
            return True  # the common case, a decode inside its last block: checked first, it runs every step
        if table is None:
            table = self.block_tables[request_id] = []
        if missing > self.pool.num_free:
            if not table:
                del self.block_tables[request_id]
            return False
        if missing > 0:
            table.extend(self.pool.allocate(missing))
        return True

    def free(self, request_id: str) -> None:
        table = self.block_tables.pop(request_id, None)
        if table:
            # Freed in reverse so the tail blocks (least likely to be shared later) are reused first.
            self.pool.free(table[::-1])

    def stats(self, num_tokens_used: int) -> KVCacheStats:
        return KVCacheStats(
            num_blocks_total=self.pool.num_blocks,
            num_blocks_used=self.pool.num_used,
            num_blocks_free=self.pool.num_free,
            num_tokens_capacity=self.pool.num_blocks * self.block_size,
            num_tokens_used=num_tokens_used,
        )

    def check_invariants(self) -> None:
        pool = self.pool
        free = list(pool._free)
        assert len(free) == len(set(free)), "a block is in the free list twice"
        assert pool.num_used + pool.num_free == pool.num_blocks, "used + free != total"
        held = Counter(block for table in self.block_tables.values() for block in table)
        for block in range(pool.num_blocks):
            assert pool.ref_count(block) == held.get(block, 0), f"block {block}: ref count != tables holding it"
        assert not set(free) & set(held), "a free block is in a block table"
        assert len(held) == pool.num_used, "used blocks do not match the blocks in tables"
