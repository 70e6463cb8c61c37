"""Which replica takes a request: pure policies over per-replica load, no Ray in here.

A replica's load combines what it last reported (running, waiting, KV blocks; a report older than
``MAX_STATS_AGE_S`` is ignored) with what this router has sent it and not yet seen finish, which
is always current. So a burst between two reports spreads out instead of landing on one replica.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import time
from dataclasses import dataclass
from typing import Any, Sequence

POLICIES = ("least_loaded", "power_of_two", "round_robin", "prefix_affinity")
MAX_STATS_AGE_S = 1.0


@dataclass
class ReplicaLoad:
    replica_id: str
    in_flight: int  # sent by this router, not finished: exact and current
    stats: dict[str, Any] | None  # the replica's latest report, None if missing or stale

    def score(self) -> float:
        """Lower is better: queue pressure per batch slot, plus the share of KV memory in use."""
        if not self.stats:
            return float(self.in_flight)
        slots = max(1, self.stats.get("max_num_seqs", 1))
        queued = max(self.in_flight, self.stats.get("num_running", 0) + self.stats.get("num_waiting", 0))
        total = max(1, self.stats.get("kv_blocks_total", 1))
        kv_used = 1.0 - self.stats.get("kv_blocks_free", total) / total
        return queued / slots + kv_used


def fresh_stats(stats: dict[str, Any] | None, now: float | None = None) -> dict[str, Any] | None:
    if not stats or "time" not in stats:
        return None
    return stats if (now or time.time()) - stats["time"] <= MAX_STATS_AGE_S else None


class RoutingPolicy:
    """Ranks replicas for one request; the first is preferred, the rest are fallbacks in order."""

    def __init__(self, policy: str = "least_loaded", load_cap: float = 1.5, seed: int | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing_policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.load_cap = load_cap
        self._rng = random.Random(seed)
        self._round_robin = itertools.count()

    def rank(self, loads: Sequence[ReplicaLoad], prefix_key: str | None = None) -> list[ReplicaLoad]:
        if not loads:
            return []
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
        return self._prefix_affinity(loads, by_load, prefix_key)

    def _prefix_affinity(self, loads: Sequence[ReplicaLoad], by_load: list[ReplicaLoad],
                         prefix_key: str | None) -> list[ReplicaLoad]:
        """Rendezvous hashing of the prompt's prefix, unless that replica is loaded past ``load_cap`` x mean."""
        if not prefix_key:
            return by_load
        home = max(loads, key=lambda r: hashlib.blake2b(f"{prefix_key}|{r.replica_id}".encode(),
                                                        digest_size=8).digest())
        mean = sum(r.score() for r in loads) / len(loads)
        if home.score() > self.load_cap * mean + 1.0 / max(1, len(loads)):
            return by_load
        return [home] + [r for r in by_load if r is not home]


def prefix_key(prompt: Any, num_chars: int = 256) -> str:
    """What prefix affinity hashes: the start of the prompt text (or of its token ids)."""
    if isinstance(prompt, str):
        return prompt[:num_chars]
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], dict):  # chat messages
            return "".join(f"{m.get('role')}:{m.get('content')}" for m in prompt)[:num_chars]
        return ",".join(map(str, prompt[:num_chars // 4]))
    return ""
