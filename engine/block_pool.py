"""Paged KV memory: a fixed pool of blocks, the block table of each request, and prefix caching.

A block is in one of three states, and the KV metrics report all three, because "used" alone
misleads (cached blocks look used but can be taken back at once):
  * live: held by at least one request's block table (ref count > 0);
  * cached: no table holds it, but it still holds the KV of a known, full block of tokens, so a
    later request with the same prefix can take it over instead of recomputing; evicted least
    recently used first when a free block is needed;
  * free: holds nothing anyone can find.

Prefix caching: a full block is identified by the hash of (its parent block's hash, its token ids),
so equal hashes mean equal prefixes up to and including that block. The token ids are kept next to
the hash and compared on a hit, so a hash collision cannot hand out the wrong KV.

Sliding-window layers (``ModelConfig.window``: Gemma's every other or five of six, Mistral's every one) read only a
request's last ``window`` positions, so their KV lives apart: a pool of its own (the window caches, sized by
``kv_budget``) and a window table per request beside its block table, entry for entry. A window block that no query
from the request's next step on can read is given back when the request next takes a block (``allocate``'s
``start``; a decoding row thus holds at most one block more than its window); its entry then holds
``null_window_block``, the window caches' scratch block, which no kernel reads (they start at the window). Prefix
caching covers both: a window block is hashed with its block tables' twin (while the request still holds it; one
given back stays findable until evicted), and a prefix is a hit only as far as the window blocks its first
computed position reads are cached too (a sliding layer's cached blocks are reused only while in the window).

Invariants (``KVCacheManager.check_invariants``, run by the tests after every path):
  * live + cached + free = total, and no block is in two of those sets;
  * a block's ref count equals the number of block tables holding it;
  * a cached block is findable by its hash, and only a full, computed block has a hash.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass

from inflight.engine.block_hash import NO_PARENT, BlockKey, block_key


class BlockPool:
    """Hands out block ids in [0, num_blocks), ref-counted so full blocks can be shared."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._cached_idle: OrderedDict[int, None] = OrderedDict()  # ref count 0 but findable; LRU first
        self._ref_counts = [0] * num_blocks
        self._hash_of: dict[int, int] = {}  # block -> its content hash (full, computed blocks only)
        self._key_of: dict[int, BlockKey] = {}
        self._block_of: dict[int, int] = {}  # content hash -> block
        self.num_shared_refs = 0  # sum over blocks of (ref count - 1) where > 0: tables sharing a block

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: free ones, and cached ones no table holds."""
        return len(self._free) + len(self._cached_idle)

    @property
    def num_used(self) -> int:
        """Live blocks: held by some request."""
        return self.num_blocks - self.num_free

    @property
    def num_cached_idle(self) -> int:
        return len(self._cached_idle)

    def allocate(self, count: int) -> list[int]:
        assert 0 <= count <= self.num_free, "caller must check num_free first"
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.popleft()
            else:  # evict the least recently used cached block: its content is forgotten
                block, _ = self._cached_idle.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
                del self._key_of[block]
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            count = self._ref_counts[block] - 1
            assert count >= 0, f"block {block} freed twice"
            self._ref_counts[block] = count
            if count > 0:
                self.num_shared_refs -= 1
            elif block in self._hash_of:
                self._cached_idle[block] = None  # most recently used last
            else:
                self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    # -- prefix caching ---------------------------------------------------------------------------------
    def lookup(self, block_hash: int, key: BlockKey) -> int | None:
        block = self._block_of.get(block_hash)
        if block is None or self._key_of[block] != key:
            return None
        return block

    def take(self, block: int) -> None:
        """Add a reference to a cached block (a prefix hit)."""
        if self._ref_counts[block] == 0:
            del self._cached_idle[block]
        else:
            self.num_shared_refs += 1
        self._ref_counts[block] += 1

    def register(self, block: int, block_hash: int, key: BlockKey) -> None:
        """Make a full, computed block findable. A second block with the same content stays anonymous."""
        if block_hash not in self._block_of and block not in self._hash_of:
            self._block_of[block_hash] = block
            self._hash_of[block] = block_hash
            self._key_of[block] = key


@dataclass(frozen=True)
class KVCacheStats:
    num_blocks_total: int
    num_blocks_used: int  # live: held by running requests
    num_blocks_cached: int  # idle but holding a reusable prefix; reclaimable at once
    num_blocks_free: int  # what a new request can get now: empty blocks plus the cached ones
    num_tokens_capacity: int
    num_tokens_used: int  # token slots holding KV of live requests (a shared block counted once)

    @property
    def num_blocks_empty(self) -> int:
        return self.num_blocks_free - self.num_blocks_cached

    @property
    def block_usage(self) -> float:
        return self.num_blocks_used / self.num_blocks_total

    @property
    def token_usage(self) -> float:
        return self.num_tokens_used / self.num_tokens_capacity


class KVCacheManager:
    """Maps each request to the blocks that hold its KV, growing the table as the request grows. ``window`` (with
    ``num_window_blocks``): the model's sliding-window layers' KV, in a pool and tables of its own (module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 window: int | None = None, num_window_blocks: int = 0) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self._block_hashes: dict[str, list[int]] = {}  # request -> hashes of its leading full blocks
        self.window = window
        self.window_pool = BlockPool(num_window_blocks) if window is not None else None
        self.window_tables: dict[str, list[int]] = {}
        self.null_window_block = num_window_blocks  # (the window caches' scratch block)
        self._window_released: dict[str, int] = {}  # request -> its leading window entries given back

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_fit(self, request_id: str, num_tokens: int) -> bool:
        """Whether the request's table could be grown to hold ``num_tokens`` tokens now."""
        missing = self.num_blocks_for(num_tokens) - len(self.block_tables.get(request_id, ()))
        return missing <= self.pool.num_free and (self.window_pool is None or missing <= self.window_pool.num_free)

    def allocate(self, request_id: str, num_tokens: int, start: int | None = None) -> bool:
        """Grow the request's table to hold ``num_tokens`` tokens. False (and no change) if blocks run out.
        ``start``: the first position the step computes; window blocks no query from it on reads go back first."""
        table = self.block_tables.get(request_id)
        if self.window is not None and start is not None and table is not None:
            self._release_window(request_id, start)
        missing = -(-num_tokens // self.block_size) - (len(table) if table is not None else 0)
        if table is not None and missing <= 0:
            return True  # the common case, a decode inside its last block: checked first, it runs every step
        window_pool = self.window_pool
        if missing > self.pool.num_free or (window_pool is not None and missing > window_pool.num_free):
            return False
        if table is None:
            table = self.block_tables[request_id] = []
            if window_pool is not None:
                self.window_tables[request_id] = []
        table.extend(self.pool.allocate(missing))
        if window_pool is not None:
            self.window_tables[request_id].extend(window_pool.allocate(missing))
        return True

    def _release_window(self, request_id: str, start: int) -> None:
        """Give back the window blocks before the one holding position ``start - window + 1``, the first any query
        from ``start`` on sees. (A step still in flight may read the last one given back; steps run in order, so
        whoever gets it next writes it only after that step.)"""
        keep_from = max(0, start - self.window + 1) // self.block_size
        released = self._window_released.get(request_id, 0)
        if keep_from > released:
            table = self.window_tables[request_id]
            keep_from = min(keep_from, len(table))
            self.window_pool.free(table[released:keep_from])
            table[released:keep_from] = [self.null_window_block] * (keep_from - released)
            self._window_released[request_id] = keep_from

    def free(self, request_id: str) -> None:
        self._block_hashes.pop(request_id, None)
        table = self.block_tables.pop(request_id, None)
        if table:
            # Freed in reverse: a prefix's tail blocks become least recently used, so its head (the
            # part other requests are likelier to share) outlives them in the cache.
            self.pool.free(table[::-1])
        if self.window_pool is not None:
            window_table = self.window_tables.pop(request_id, None)
            if window_table:
                self.window_pool.free(window_table[self._window_released.pop(request_id, 0):][::-1])

    # -- prefix caching ------------------------------------------------------------------------------------
    def match_prefix(self, request_id: str, token_ids: list[int], root: int = NO_PARENT) -> int:
        """Give a request with no blocks yet the cached blocks of its longest cached prefix; returns how
        many tokens they hold. At least one token is left to compute: its logits are needed, and no
        shared block is ever written to."""
        if not self.enable_prefix_caching or request_id in self.block_tables:
            return 0
        bs, pool = self.block_size, self.pool
        hashes, keys, blocks, parent = [], [], [], root
        for index in range((len(token_ids) - 1) // bs):
            key = block_key(parent, token_ids, index, bs)
            block_hash = hash(key)
            block = pool.lookup(block_hash, key)
            if block is None:
                break
            hashes.append(block_hash)
            keys.append(key)
            blocks.append(block)
            parent = block_hash
        window = None
        while blocks and self.window is not None:  # as far as the window blocks its first query reads are cached
            window = self._cached_window(hashes, keys, len(blocks))
            if window is not None:
                break
            del blocks[-1], hashes[-1]
        if not blocks:
            return 0
        for block in blocks:
            pool.take(block)
        self.block_tables[request_id] = blocks
        self._block_hashes[request_id] = hashes
        if window is not None:
            first, found = window
            for block in found:
                self.window_pool.take(block)
            self.window_tables[request_id] = [self.null_window_block] * first + found
            self._window_released[request_id] = first
        return len(blocks) * bs

    def _cached_window(self, hashes: list[int], keys: list[BlockKey], count: int) -> tuple[int, list[int]] | None:
        """(the first, the window blocks) a request whose first ``count`` blocks are a hit reads from its first
        computed position on, if all are cached; else None."""
        first = max(0, count * self.block_size - self.window + 1) // self.block_size
        found = []
        for index in range(first, count):
            block = self.window_pool.lookup(hashes[index], keys[index])
            if block is None:
                return None
            found.append(block)
        return first, found

    def cache_computed_blocks(self, request_id: str, token_ids: list[int], num_computed: int,
                              root: int = NO_PARENT) -> None:
        """Register the request's blocks that became full and computed since the last call (``root``: the
        first block's parent, ``block_hash.salted_root`` of the request's cache salt)."""
        hashes = self._block_hashes.setdefault(request_id, [])
        bs, table, pool = self.block_size, self.block_tables[request_id], self.pool
        parent = hashes[-1] if hashes else root
        window = self.window_tables.get(request_id) if self.window_pool is not None else None
        for index in range(len(hashes), num_computed // bs):
            key = block_key(parent, token_ids, index, bs)
            parent = hash(key)
            hashes.append(parent)
            pool.register(table[index], parent, key)
            if window is not None and window[index] != self.null_window_block:  # (not given back already)
                self.window_pool.register(window[index], parent, key)

    def num_hashed_blocks(self, request_id: str) -> int:
        return len(self._block_hashes.get(request_id, ()))

    # -- accounting ----------------------------------------------------------------------------------------
    def stats(self, num_tokens_logical: int) -> KVCacheStats:
        """``num_tokens_logical``: the live requests' computed tokens, each counted per request; blocks
        shared by several requests are full, so each extra reference overcounts a whole block."""
        pool = self.pool
        return KVCacheStats(
            num_blocks_total=pool.num_blocks,
            num_blocks_used=pool.num_used,
            num_blocks_cached=pool.num_cached_idle,
            num_blocks_free=pool.num_free,
            num_tokens_capacity=pool.num_blocks * self.block_size,
            num_tokens_used=num_tokens_logical - pool.num_shared_refs * self.block_size,
        )

    def window_blocks_used(self) -> int:
        return self.window_pool.num_used if self.window_pool is not None else 0

    def check_invariants(self) -> None:
        if self.window_pool is not None:
            assert self.window_tables.keys() == self.block_tables.keys(), "a window table without a block table"
            held = Counter(block for rid, table in self.window_tables.items()
                           for block in table[self._window_released.get(rid, 0):])
            assert self.null_window_block not in held, "a held window entry names the scratch block"
            assert all(self.window_pool.ref_count(block) == n for block, n in held.items()), "window ref counts"
            assert len(held) == self.window_pool.num_used, "window blocks held != used"
            assert all(len(self.window_tables[rid]) == len(t) for rid, t in self.block_tables.items())
        pool = self.pool
        free, idle = list(pool._free), list(pool._cached_idle)
        assert len(free) == len(set(free)), "a block is in the free list twice"
        assert not set(free) & set(idle), "a block is both free and cached"
        held = Counter(block for table in self.block_tables.values() for block in table)
        live = set(held)
        assert len(live) + len(free) + len(idle) == pool.num_blocks, "live + cached + free != total"
        assert not live & (set(free) | set(idle)), "a block in a table is also free or cached"
        for block in range(pool.num_blocks):
            assert pool.ref_count(block) == held.get(block, 0), f"block {block}: ref count != tables holding it"
        assert pool.num_shared_refs == sum(n - 1 for n in held.values()), "shared reference count is off"
        for block in idle:
            assert block in pool._hash_of, f"cached block {block} has no hash"
        for block_hash, block in pool._block_of.items():
            assert pool._hash_of[block] == block_hash, f"block {block} and its hash disagree"
        assert len(pool._block_of) == len(pool._hash_of) == len(pool._key_of)
