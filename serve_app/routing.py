"""Which replica takes a request: pure policies over per-replica load, no Ray in here.

A replica's load combines what it last reported (running, waiting, KV blocks; a report older than
``MAX_STATS_AGE_S`` is ignored) with what this router has sent it and not yet seen finish, which
is always current. So a burst between two reports spreads out instead of landing on one replica.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import OrderedDict, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from inflight.engine.block_hash import block_hashes, request_salt, salted_root
from inflight.serve_app.messages import GenerateRequest, ReplicaStats

POLICIES = ("least_loaded", "power_of_two", "round_robin", "prefix_affinity")
MAX_STATS_AGE_S = 1.0
MAX_HASHED_BLOCKS = 512  # prefix affinity looks at this many leading blocks of a prompt at most
DEFAULT_INDEX_BLOCKS = 8192  # blocks remembered per replica until it reports its KV size


@dataclass
class ReplicaLoad:
    replica_id: str
    in_flight: int  # sent by this router, not finished: exact and current
    stats: ReplicaStats | None  # the replica's latest report, None if missing or stale
    slots_if_unknown: int = 1  # batch slots assumed without a report: its peers' (``RoutingPolicy.rank`` sets it)

    def score(self) -> float:
        """Lower is better: queue pressure per batch slot, plus the share of KV memory in use."""
        if not self.stats:
            return self.in_flight / self.slots_if_unknown
        stats = self.stats
        slots = max(1, stats.max_num_seqs)
        queued = max(self.in_flight, stats.num_running + stats.num_waiting)
        total = max(1, stats.kv_blocks_total)
        kv_used = 1.0 - (total if stats.kv_blocks_free is None else stats.kv_blocks_free) / total
        return queued / slots + kv_used


def fresh_stats(stats: ReplicaStats | None, now: float | None = None) -> ReplicaStats | None:
    """``stats`` if it is recent enough to rank by (a report without a time never is), else None."""
    if stats is None or not stats.time:
        return None
    return stats if (now or time.time()) - stats.time <= MAX_STATS_AGE_S else None


class RoutingPolicy:
    """Ranks replicas for one request; the first is preferred, the rest are fallbacks in order."""

    def __init__(self, policy: str = "least_loaded", load_cap: float = 1.5, seed: int | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing_policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.load_cap = load_cap
        self._rng = random.Random(seed)
        self._round_robin = itertools.count()
        self.prefix_index = PrefixIndex()

    def choose(self, candidates: Sequence[tuple[str, int, ReplicaStats | None]],
               request: GenerateRequest | None = None, now: float | None = None) -> list[str]:
        """The replicas for ``request`` best first, by id: what both the Serve request router
        (``request_router.py``) and the router's choice of a connection (``replica_client.py``) ask, each with its
        candidates as (replica id, this router's requests on it, its latest stats)."""
        now = time.time() if now is None else now
        loads = [ReplicaLoad(replica_id, in_flight, fresh_stats(stats, now))
                 for replica_id, in_flight, stats in candidates]
        hashes = request_block_hashes(self, request, [stats for _, _, stats in candidates])
        return [load.replica_id for load in self.rank(loads, hashes)]

    def rank(self, loads: Sequence[ReplicaLoad], block_hashes: Sequence[int] | None = None) -> list[ReplicaLoad]:
        """Replicas best first for one request; ``block_hashes``: its prompt's (``prompt_block_hashes``),
        for prefix affinity."""
        if not loads:
            return []
        # A replica without a fresh report (just started) is scored on the same scale as its peers: in flight per
        # batch slot, as many slots as theirs. Scored per request instead, it would look several times as loaded
        # as a reporting replica with the same requests, and a burst would skip it.
        slots = max((load.stats.max_num_seqs for load in loads if load.stats), default=1)
        for load in loads:
            load.slots_if_unknown = max(1, slots)
        by_load = sorted(loads, key=lambda r: (r.score(), self._rng.random()))
        if self.policy == "least_loaded":
            return by_load
        if self.policy == "power_of_two":
            pair = self._rng.sample(list(loads), min(2, len(loads)))
            first = min(pair, key=lambda r: r.score())
            return [first] + [r for r in by_load if r is not first]
        if self.policy == "round_robin":
            start = next(self._round_robin) % len(loads)
            ordered = sorted(loads, key=lambda r: r.replica_id)
            return ordered[start:] + ordered[:start]
        return self._prefix_affinity(loads, by_load, block_hashes)

    def _prefix_affinity(self, loads: Sequence[ReplicaLoad], by_load: list[ReplicaLoad],
                         block_hashes: Sequence[int] | None) -> list[ReplicaLoad]:
        """The replica already sent the longest run of this prompt's leading blocks (so likeliest to hold them
        in its prefix cache), unless it is loaded past ``load_cap`` x the mean; a prompt no replica has seen
        goes to the least loaded one. Either way the choice is recorded, so the next request with this
        prefix (even one decided in the same burst, before this one is sent) follows it."""
        if not block_hashes:
            return by_load
        matched = {r.replica_id: self.prefix_index.num_matched(r.replica_id, block_hashes) for r in loads}
        best = max(by_load, key=lambda r: matched[r.replica_id])  # max keeps the first: the least loaded of ties
        mean = sum(r.score() for r in loads) / len(loads)
        overloaded = best.score() > self.load_cap * mean + 1.0 / max(1, len(loads))
        home = best if matched[best.replica_id] and not overloaded else by_load[0]
        capacity = home.stats.kv_blocks_total if home.stats else DEFAULT_INDEX_BLOCKS
        self.prefix_index.record(home.replica_id, block_hashes, capacity)
        return [home] + [r for r in by_load if r is not home]


class PrefixIndex:
    """The prompt blocks (by ``engine.block_hash`` hash) this router has sent each replica, least recently
    sent first: a model of each replica's prefix cache, which also evicts its least recently used blocks.
    It is bounded by the replica's KV size, so it forgets about when the cache would have."""

    def __init__(self) -> None:
        self._sent: dict[str, OrderedDict[int, None]] = defaultdict(OrderedDict)

    def num_matched(self, replica_id: str, block_hashes: Sequence[int]) -> int:
        """How many of the leading blocks the replica was sent (a block's hash names its whole prefix, so
        the first miss ends the run)."""
        sent = self._sent.get(replica_id)
        if not sent:
            return 0
        count = 0
        for block_hash in block_hashes:
            if block_hash not in sent:
                break
            count += 1
        return count

    def record(self, replica_id: str, block_hashes: Sequence[int], capacity: int) -> None:
        sent = self._sent[replica_id]
        for block_hash in block_hashes:
            sent[block_hash] = None
            sent.move_to_end(block_hash)
        while len(sent) > max(1, capacity):
            sent.popitem(last=False)

    def forget_except(self, replica_ids: set[str]) -> None:
        """Drop replicas that are gone (a restarted replica comes back with an empty cache and a new id)."""
        for replica_id in [r for r in self._sent if r not in replica_ids]:
            del self._sent[replica_id]


def prompt_block_hashes(token_ids: Sequence[int] | None, stats: Sequence[ReplicaStats | None],
                        cache_salt: str | None = None) -> list[int]:
    """The prompt's leading block hashes at the replicas' block size (from their reports; every replica of a
    deployment runs the same engine configuration), salted as the engine salts them, or none when no replica
    has reported it yet."""
    block_size = next((s.block_size for s in stats if s and s.block_size), None)
    if not token_ids or block_size is None:
        return []
    return block_hashes(token_ids, block_size, MAX_HASHED_BLOCKS, salted_root(cache_salt))


def request_block_hashes(policy: RoutingPolicy, request: Any,
                         stats: Sequence[ReplicaStats | None]) -> list[int] | None:
    """What ``RoutingPolicy.rank`` needs of a replica request under its policy: the prompt's block hashes for
    prefix affinity, salted by its cache salt and tenant as the engine salts them; else None."""
    if policy.policy != "prefix_affinity" or not isinstance(request, GenerateRequest):
        return None
    params = request.params
    return prompt_block_hashes(request.prompt_token_ids, stats,
                               request_salt(params.get("cache_salt"), params.get("tenant")))
