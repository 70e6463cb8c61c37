"""Content hashes of a prompt's full KV blocks: the prefix cache's keys, and what prefix-affinity routing hashes.

Block ``i`` is keyed by (the hash of block ``i - 1``, block ``i``'s token ids), so one hash names the
whole prefix up to the end of its block: two prompts share block ``i``'s hash exactly when they share
their first ``(i + 1) * block_size`` tokens (up to hash collisions, which the block pool rules out by
comparing the key on a hit). Python's ``hash`` of a tuple of ints is the same in every process
(``PYTHONHASHSEED`` salts only str and bytes), so a router can compute the hashes a replica's engine uses.
The first block's parent is ``NO_PARENT``, an int: ``hash(None)`` is the object's address in
CPython 3.11, different in every process. A request with a cache salt (``SamplingParams.cache_salt``; the
server sets one per tenant) chains from ``salted_root(salt)`` instead, so requests with different salts
never share a cached block, whatever their tokens. No torch here: the router imports it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

BlockKey = tuple[int, tuple[int, ...]]  # (parent block's hash, this block's token ids)
NO_PARENT = 0  # the first block's parent


def long_rope_root(root: int) -> int:
    """The root of a LongRoPE sequence rotated long (engine/models/rope.py) whose short twin chains from ``root``:
    its KV is another, so its blocks must not meet the short ones'. A tuple of ints: the same in every process."""
    return hash((root, 1))


def block_key(parent: int, token_ids: Sequence[int], index: int, block_size: int) -> BlockKey:
    """The key of block ``index`` of ``token_ids`` (a full block) whose predecessor's hash is ``parent``."""
    return parent, tuple(token_ids[index * block_size:(index + 1) * block_size])


def request_salt(cache_salt: str | None, tenant: str | None) -> str | None:
    """The salt a request's prefix-cache hashes use: its own ``cache_salt``, else its tenant's, else none."""
    if cache_salt is not None:
        return cache_salt
    return f"tenant:{tenant}" if tenant is not None else None


def salted_root(salt: str | None) -> int:
    """The first block's parent for requests with this cache salt: the same in every process (not ``hash``
    of a str, which PYTHONHASHSEED varies), never ``NO_PARENT`` for a salt."""
    if salt is None:
        return NO_PARENT
    return int.from_bytes(hashlib.sha256(salt.encode()).digest()[:8], "big") | 1


def block_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int | None = None,
                 root: int = NO_PARENT) -> list[int]:
    """The chained hashes of the leading full blocks of ``token_ids`` (at most ``max_blocks`` of them);
    ``root``: the first block's parent (``salted_root``)."""
    num_blocks = len(token_ids) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    hashes: list[int] = []
    parent = root
    for index in range(num_blocks):
        parent = hash(block_key(parent, token_ids, index, block_size))
        hashes.append(parent)
    return hashes
