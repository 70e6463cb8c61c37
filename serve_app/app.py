"""Build the Ray Serve application: ``Router`` (ingress) -> ``LLMReplica`` x N.

``serve run configs/demo.yaml``, or ``serve run serve_app.app:build_app model=/path/to/checkpoint``.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from inflight.serve_app.config import AppConfig
from inflight.serve_app.replica import LLMReplica
from inflight.serve_app.ingress import Router

ROUTER_DRAIN_EXTRA_S = 60.0


def build_app(args: dict[str, Any]):
    """Serve's application builder: ``args`` from the config file or ``serve run ... key=value``."""
    return make_app(AppConfig.model_validate(args or {}))


def make_app(config: AppConfig, engine_cls: type | None = None):
    """Compose the application; ``engine_cls`` swaps the engine class the replicas hold."""
    actor_options: dict[str, Any] = {"num_cpus": config.num_cpus_per_replica, "num_gpus": config.num_gpus_per_replica}
    if config.replica_resources:
        actor_options["resources"] = dict(config.replica_resources)
    # Serve writes an access-log line per request in every deployment it passes (formatting, a file, the
    # driver's console): measurable CPU on a small machine serving many short requests, so it is opt-in.
    logging_config = {"enable_access_log": config.access_log}
    replica_options: dict[str, Any] = {
        "ray_actor_options": actor_options,
        "max_ongoing_requests": config.max_ongoing_requests_per_replica,
        "request_router_config": RequestRouterConfig(
            request_router_class="inflight.serve_app.request_router:LLMRequestRouter",
            request_router_kwargs={"policy": config.routing_policy},
            request_routing_stats_period_s=config.routing_stats_period_s,
            request_routing_stats_timeout_s=5.0,
        ),
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 10.0,
        "logging_config": logging_config,
        # Draining (scale-down, redeploy): requests in flight get drain_timeout_s to finish; Serve then stops the
        # replica and the router continues what is left on another replica (serve_app.migration, max_migrations).
        "graceful_shutdown_timeout_s": config.drain_timeout_s,
        "graceful_shutdown_wait_loop_s": 1.0,
    }
    replica_options.update(config.placement())  # tensor parallelism: a bundle per rank (serve_app.rank_actors)
    if config.autoscaling_config:
        replica_options["autoscaling_config"] = config.autoscaling_config
    else:
        replica_options["num_replicas"] = config.num_replicas
    replica_kwargs: dict[str, Any] = {"model": config.model, "engine_args": config.engine_args,
                                      "served_model_name": config.model_name,
                                      "max_queued_requests": config.max_queued_requests_per_replica,
                                      "max_messages_per_s": config.max_messages_per_s,
                                      "engine_process": config.engine_process, "engine_cpus": config.engine_cpus,
                                      "stats_period_s": config.routing_stats_period_s,
                                      "rank_bundle": config.rank_bundle()}
    if engine_cls is not None:
        replica_kwargs["engine_cls"] = engine_cls
    replicas = serve.deployment(LLMReplica).options(**replica_options).bind(**replica_kwargs)
    router_actor_options: dict[str, Any] = {"num_cpus": config.router_num_cpus}
    if config.router_resources:
        router_actor_options["resources"] = dict(config.router_resources)
    router = serve.deployment(Router).options(
        num_replicas=config.router_replicas, max_ongoing_requests=config.max_pending_requests * 4,
        ray_actor_options=router_actor_options, logging_config=logging_config,
        # A router holds its clients' connections: it has the replicas' drain and a minute more for migrations.
        graceful_shutdown_timeout_s=config.drain_timeout_s + ROUTER_DRAIN_EXTRA_S, graceful_shutdown_wait_loop_s=1.0,
    )
    return router.bind(replicas, config.router_config())
