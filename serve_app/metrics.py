"""Prometheus metrics through ``ray.serve.metrics``: Ray exports them (prefixed ``ray_``) on its metrics port.

Replicas own the engine-side series; the router owns admission rejections and timeouts it decides itself.
"""

from __future__ import annotations

from typing import Any

from ray.serve import metrics

LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
STEP_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]


class ReplicaMetrics:
    def __init__(self) -> None:
        # Serve tags every series with its application, deployment and replica; that names the model too.
        def gauge(name: str, doc: str) -> metrics.Gauge:
            return metrics.Gauge(name, description=doc)

        def counter(name: str, doc: str) -> metrics.Counter:
            return metrics.Counter(name, description=doc)

        def histogram(name: str, doc: str, buckets: list[float]) -> metrics.Histogram:
            return metrics.Histogram(name, description=doc, boundaries=buckets)

        self.kv_usage = gauge("llm_kv_cache_usage_ratio", "KV blocks in use / total blocks")
        self.kv_token_usage = gauge("llm_kv_cache_token_usage_ratio",
                                    "KV token slots holding data / all token slots (the gap to block usage is fragmentation)")
        # Three disjoint states of a KV block (block usage alone misleads: cached blocks are reclaimable).
        self.kv_blocks_live = gauge("llm_kv_blocks_live", "KV blocks held by running requests")
        self.kv_blocks_cached = gauge("llm_kv_blocks_cached",
                                      "idle KV blocks holding a reusable prefix (reclaimable at once)")
        self.kv_blocks_empty = gauge("llm_kv_blocks_empty", "KV blocks holding nothing")
        self.prefix_hit_rate = gauge("llm_prefix_cache_hit_rate",
                                     "prompt tokens found in the prefix cache / prompt tokens looked up, since start")
        self.kv_underused = gauge("llm_kv_cache_underused",
                                  "1 while token-level KV use stays under 60% with requests waiting: a limit other "
                                  "than memory is hit (the cause is in /stats kv_diagnosis and the replica's log)")
        self.running = gauge("llm_num_requests_running", "requests holding a batch slot")
        self.waiting = gauge("llm_num_requests_waiting", "requests queued in the engine")
        self.batch_size = gauge("llm_batch_size", "rows in the latest engine step")
        self.ttft = histogram("llm_time_to_first_token_seconds", "arrival to first token", LATENCY_BUCKETS_S)
        self.tpot = histogram("llm_time_per_output_token_seconds", "mean time between output tokens",
                              STEP_BUCKETS_S)
        self.e2e = histogram("llm_e2e_request_latency_seconds", "arrival to finish", LATENCY_BUCKETS_S)
        self.queue_time = histogram("llm_request_queue_time_seconds", "arrival to first scheduled",
                                    LATENCY_BUCKETS_S)
        self.step_time = histogram("llm_scheduler_step_seconds", "one engine step (schedule, run, outputs)",
                                   STEP_BUCKETS_S)
        self.preemptions = counter("llm_num_preemptions", "requests preempted for KV blocks")
        self.rejections = counter("llm_admission_rejections", "requests refused with 429")
        self.timeouts = counter("llm_request_timeouts", "requests ended by their deadline")
        self.prompt_tokens = counter("llm_prompt_tokens", "prompt tokens of admitted requests")
        self.generation_tokens = counter("llm_generation_tokens", "tokens generated")
        # Speculative decoding (engine.speculative), by method: what is proposed, what verification keeps.
        self.spec_proposed = metrics.Counter("llm_spec_proposed_tokens", description="tokens proposed for "
                                             "verification (speculative decoding)", tag_keys=("method",))
        self.spec_accepted = metrics.Counter("llm_spec_accepted_tokens", description="proposed tokens accepted "
                                             "(speculative decoding)", tag_keys=("method",))
        self.spec_acceptance = metrics.Gauge("llm_spec_acceptance_rate", description="accepted / proposed tokens "
                                             "since start (speculative decoding)", tag_keys=("method",))
        self._last_preemptions = 0
        self._last_spec = (0, 0)

    def observe_step(self, seconds: float, batch_size: int) -> None:
        # The batch-size gauge is set in observe_stats with the others: Ray 2.60 drops a gauge from its export once
        # it goes unset for two export intervals, so one set only by steps vanished while the replica sat idle.
        self.step_time.observe(seconds)

    def observe_stats(self, stats: dict[str, Any]) -> None:
        self.kv_usage.set(stats["kv_block_usage"])
        self.kv_token_usage.set(stats["kv_token_usage"])
        self.kv_blocks_live.set(stats["kv_blocks_used"])
        self.kv_blocks_cached.set(stats["kv_blocks_cached"])
        self.kv_blocks_empty.set(stats["kv_blocks_empty"])
        if stats["prefix_cache_query_tokens"]:
            self.prefix_hit_rate.set(stats["prefix_cache_hit_tokens"] / stats["prefix_cache_query_tokens"])
        self.kv_underused.set(1.0 if stats.get("kv_diagnosis") else 0.0)
        self.batch_size.set(stats["batch_size"])
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        new_preemptions = stats["num_preemptions"] - self._last_preemptions
        if new_preemptions > 0:
            self.preemptions.inc(new_preemptions)
        self._last_preemptions = stats["num_preemptions"]
        if "spec_method" in stats:
            self._observe_speculation(stats)

    def _observe_speculation(self, stats: dict[str, Any]) -> None:
        tags = {"method": stats["spec_method"]}
        proposed, accepted = stats["spec_num_proposed_tokens"], stats["spec_num_accepted_tokens"]
        if proposed > self._last_spec[0]:
            self.spec_proposed.inc(proposed - self._last_spec[0], tags=tags)
        if accepted > self._last_spec[1]:
            self.spec_accepted.inc(accepted - self._last_spec[1], tags=tags)
        if stats["spec_acceptance_rate"] is not None:
            self.spec_acceptance.set(stats["spec_acceptance_rate"], tags=tags)
        self._last_spec = (proposed, accepted)

    def observe_finished(self, metrics_: Any, num_output_tokens: int, timed_out: bool) -> None:
        arrival = metrics_.arrival_time
        if metrics_.first_token_time is not None:
            self.ttft.observe(metrics_.first_token_time - arrival)
            if num_output_tokens > 1 and metrics_.finished_time is not None:
                self.tpot.observe((metrics_.finished_time - metrics_.first_token_time) / (num_output_tokens - 1))
        if metrics_.first_scheduled_time is not None:
            self.queue_time.observe(metrics_.first_scheduled_time - arrival)
        if metrics_.finished_time is not None:
            self.e2e.observe(metrics_.finished_time - arrival)
        if timed_out:
            self.timeouts.inc()


class RouterMetrics:
    def __init__(self) -> None:
        self.rejections = metrics.Counter("llm_admission_rejections", description="requests refused with 429")
        self.tenant_requests = metrics.Counter("llm_tenant_requests", description="requests served, by tenant",
                                               tag_keys=("tenant",))
        self.tenant_tokens = metrics.Counter("llm_tenant_tokens", description="prompt + output tokens, by tenant",
                                             tag_keys=("tenant",))
        self.tenant_rejections = metrics.Counter("llm_tenant_rejections",
                                                 description="requests refused by a tenant's limits (429)",
                                                 tag_keys=("tenant",))
        self.timeouts = metrics.Counter("llm_request_timeouts", description="requests ended by their deadline")
        self.migrations = metrics.Counter("llm_migrations", description="requests continued on another replica "
                                          "mid-generation, by why the first one stopped", tag_keys=("reason",))
