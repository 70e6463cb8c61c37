"""Serve autoscaling on engine load: how full each replica's batch and KV cache are, not a request count.

Serve's default policy scales on ongoing requests per replica against ``target_ongoing_requests``
(default 2). A continuous-batching replica runs ``max_num_seqs`` requests at once (256 on a GPU), so
that count says nothing until it is compared with the replica's capacity; and a replica whose KV
cache is full is saturated with most of its batch slots empty (long prompts), which a request count
cannot see at all.

So each replica reports its load (``record_autoscaling_stats``; Serve averages it over
``look_back_period_s``) as the larger of

- slot load: requests it holds, running + waiting, over its batch slots (``max_num_seqs``);
- KV load: the share of KV blocks in use, scaled up by waiting / running (the waiting requests will
  need about what the running ones hold each),

and ``LLMLoadPolicy`` asks for ``total load / target_load`` replicas, plus the requests Serve holds at
handles (no replica would take them) counted against an average replica's slots. ``1.0`` is a
replica exactly full; the default target of 0.8 keeps headroom for bursts while new replicas start.
Serve applies ``min_replicas``/``max_replicas``, ``upscale_delay_s``/``downscale_delay_s`` and the
scaling factors to what the policy returns.
"""

from __future__ import annotations

from typing import Any

LOAD_METRIC = "llm_engine_load"
SLOTS_METRIC = "llm_max_num_seqs"
POLICY_PATH = "inflight.serve_app.autoscaling:LLMLoadPolicy"


def replica_load(stats: dict[str, Any]) -> float:
    """One replica's load from its engine stats; 1.0 is full (every slot used, or the KV cache)."""
    running, waiting = stats["num_running"], stats["num_waiting"]
    slot_load = (running + waiting) / max(1, stats["max_num_seqs"])
    kv_used = stats["kv_blocks_used"] / max(1, stats["kv_blocks_total"])
    kv_load = kv_used * (running + waiting) / running if running else kv_used
    return max(slot_load, kv_load)


def autoscaling_metrics(stats: dict[str, Any]) -> dict[str, float]:
    """What a replica reports to Serve's autoscaler (numbers only: Serve rejects anything else)."""
    return {LOAD_METRIC: float(replica_load(stats)), SLOTS_METRIC: float(stats["max_num_seqs"])}


class LLMLoadPolicy:
    """Serve custom autoscaling policy (``AutoscalingConfig.policy``); Serve builds it once with ``policy_kwargs``.

    Returns the desired replica count as a float; Serve rounds it up and applies bounds and delays.
    """

    def __init__(self, target_load: float = 0.8) -> None:
        if not isinstance(target_load, (int, float)) or isinstance(target_load, bool) or not 0 < target_load <= 1:
            raise ValueError(f"LLMLoadPolicy target_load must be a number in (0, 1], got {target_load!r}")
        self.target_load = float(target_load)

    def __call__(self, ctx) -> tuple[float, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        loads = metrics.get(LOAD_METRIC, {})
        slots = metrics.get(SLOTS_METRIC, {})
        return desired_replicas(list(loads.values()), list(slots.values()), ctx.total_queued_requests or 0.0,
                                ctx.current_num_replicas, self.target_load), {}


def desired_replicas(loads: list[float], slots: list[float], queued_at_handles: float, num_running: int,
                     target_load: float) -> float:
    """Replicas needed for ``loads`` (one per reporting replica) plus requests no replica has taken yet.

    Before any replica has reported (just started) the count stays where it is: no data is no reason to
    scale either way.
    """
    if not loads:
        return float(num_running)
    mean_slots = sum(slots) / len(slots) if slots else 1.0
    total = sum(loads) + queued_at_handles / max(1.0, mean_slots)
    return total / target_load
