"""The application's arguments: pydantic at the edge (serve config files, ``serve run ... key=value``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from inflight.engine.config import EngineConfig
from inflight.engine.cpu_list import parse_cpu_list
from inflight.engine.models.packaged import DEFAULT_MODEL
from inflight.serve_app.admission import TenantLimits
from inflight.serve_app.autoscaling import POLICY_PATH, LLMLoadPolicy


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    served_model_name: str
    model: str = DEFAULT_MODEL  # what the replicas load: the router reads its tokenizer for prefix affinity
    routing_policy: str = "least_loaded"
    max_pending_requests: int = Field(default=256, ge=1)  # in flight through one router; more get 429
    default_timeout_s: float = Field(default=120.0, gt=0)  # deadline when a request brings no `timeout`
    max_attempts: int = Field(default=3, ge=1)  # tries of a request whose replica died before it started
    max_migrations: int = Field(default=3, ge=0)  # continuations of a request whose replica was lost mid-way
    api_keys_file: str | None = None  # serve_app.gate: one "tenant key" a line (and INFLIGHT_API_KEYS)
    body_timeout_s: float = Field(default=30.0, gt=0)  # serve_app.gate: a body not received whole by then is a 408
    tenant_limits: dict[str, TenantLimits] = Field(default_factory=dict)
    default_tenant_limits: TenantLimits | None = None
    stream_channel: bool = True  # serve_app.stream_channel
    max_requests_per_replica: int = Field(default=512, ge=1)  # sent down one replica's connection at once


class AppConfig(BaseModel):
    """Everything ``build_app`` takes. Engine arguments are checked by the engine's own ``EngineConfig``."""

    model_config = ConfigDict(extra="forbid")

    model: str = DEFAULT_MODEL  # a packaged model's name, a .gguf file, a checkpoint directory, or demo-tiny
    served_model_name: str | None = None
    engine_args: dict[str, Any] = Field(default_factory=dict)
    num_replicas: int | Literal["auto"] = 1
    # Serve's AutoscalingConfig; `policy` defaults to serve_app.autoscaling's engine-load policy.
    autoscaling_config: dict[str, Any] | None = None
    num_gpus_per_replica: float = Field(default=0.0, ge=0)
    num_cpus_per_replica: float = Field(default=1.0, ge=0)
    replica_resources: dict[str, float] = Field(default_factory=dict)  # custom resources replicas require
    max_ongoing_requests_per_replica: int = Field(default=512, ge=1)
    max_queued_requests_per_replica: int = Field(default=256, ge=1)  # engine queue bound; beyond it 429
    max_messages_per_s: float = Field(default=200.0, gt=0)  # per replica: streams share it, tokens batch up
    max_pending_requests: int = Field(default=256, ge=1)
    default_timeout_s: float = Field(default=120.0, gt=0)
    max_attempts: int = Field(default=3, ge=1)
    # A request whose replica is lost mid-generation continues on another from the tokens already sent, exactly
    # (same stream, nothing repeated or missing), this many times at most (serve_app.migration).
    max_migrations: int = Field(default=3, ge=0)
    # A replica being stopped (scale-down, a redeploy with a changed config, a node drained) takes no new request
    # and has this long to finish its requests (Serve's graceful_shutdown_timeout_s); the rest then continue on
    # other replicas (max_migrations). A router being replaced finishes its streams within this plus a minute.
    drain_timeout_s: float = Field(default=30.0, gt=0)
    routing_policy: Literal["least_loaded", "power_of_two", "round_robin", "prefix_affinity"] = "least_loaded"
    routing_stats_period_s: float = Field(default=0.5, gt=0)
    router_replicas: int = Field(default=1, ge=1)
    router_num_cpus: float = Field(default=0.0, ge=0)  # 0: routers may share any node, even a num-cpus "0" head
    router_resources: dict[str, float] = Field(default_factory=dict)  # custom resources routers require (pinning)
    access_log: bool = False  # Serve's per-request access-log line in the Router and LLMReplica logs
    # The engine's step loop in a process of its own beside each replica (engine.engine_core), so that the
    # replica's event loop (Ray's messages, streaming) and the engine's steps never wait for one GIL; false:
    # on a thread of the replica's process.
    engine_process: bool = True
    # CPUs for each replica's engine process ("0", "0-3"), so that it has cores of its own: the engine is the
    # one process here that is compute-bound, and a core it shares with the proxy, router and Ray's processes
    # slows every step. `scripts/serve.sh` (make run) starts Ray on the other CPUs (serve_app.cpu_plan).
    engine_cpus: str | None = None
    # API keys: a file of "tenant key" lines (on Kubernetes a mounted Secret), read by each router, plus the
    # INFLIGHT_API_KEYS environment variable; none of either: an open server. Never the keys themselves here.
    api_keys_file: str | None = None
    # Per tenant (an API key's), at each router: requests in flight and tokens per minute; beyond: 429 with
    # Retry-After (serve_app.admission.TenantLimiter). default_tenant_limits: for tenants not named here.
    tenant_limits: dict[str, TenantLimits] = Field(default_factory=dict)
    default_tenant_limits: TenantLimits | None = None
    # A request body not received whole within this many seconds (a client trickling it) is answered 408 and
    # its connection closed (serve_app.gate); the body is read before admission, so it never holds a slot.
    body_timeout_s: float = Field(default=30.0, gt=0)
    # Each replica keeps a TCP connection to each router (serve_app.stream_channel): requests go down it and their
    # tokens come back up it, rather than as Serve calls and their items (a Ray call and a Ray message per item cost
    # CPU the engine needs, and the first token two hops); Serve still runs, heals, drains and scales the replicas.
    # The router listens on its node's address, on a port the OS picks (open it between the Ray pods, as Ray's own
    # ports). false: all through Serve.
    stream_channel: bool = True

    @field_validator("api_keys_file")
    @classmethod
    def _api_keys_readable(cls, value: str | None) -> str | None:
        if value is not None:
            from inflight.serve_app.gate import load_api_keys

            load_api_keys(value, environ={})  # a missing or malformed file fails here, before anything starts
        return value

    @field_validator("engine_args")
    @classmethod
    def _engine_args_valid(cls, value: dict[str, Any]) -> dict[str, Any]:
        EngineConfig.from_kwargs(**value)  # raises ValueError naming a bad argument, before anything starts
        if "model" in value:
            raise ValueError("set the model with the top-level `model`, not inside engine_args")
        return value

    @field_validator("num_replicas")
    @classmethod
    def _num_replicas_valid(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:  # (Serve would refuse it only once Ray runs)
            raise ValueError(f"num_replicas must be at least 1, or 'auto', got {value}")
        return value

    @field_validator("engine_cpus")
    @classmethod
    def _engine_cpus_valid(cls, value: str | None) -> str | None:
        if value is not None:
            parse_cpu_list(value)  # ValueError naming engine_cpus
        return value

    @model_validator(mode="after")
    def _engine_cpus_need_a_process(self):
        if self.engine_cpus is not None and not self.engine_process:
            raise ValueError("engine_cpus needs engine_process: true (the CPUs are the engine process's)")
        return self

    @model_validator(mode="after")
    def _ranks_have_resources(self):
        if self.tensor_parallel_size > 1:
            if not self.engine_process:
                raise ValueError("engine_args.tensor_parallel_size > 1 needs engine_process: true")
            if self.engine_cpus is not None:
                raise ValueError("engine_cpus: not with engine_args.tensor_parallel_size > 1 (each rank is placed "
                                 "by its placement-group bundle)")
            if not self.rank_bundle():
                raise ValueError("num_cpus_per_replica or num_gpus_per_replica must be > 0 with "
                                 "engine_args.tensor_parallel_size > 1 (each rank reserves a placement-group bundle "
                                 "of them)")
        return self

    @property
    def tensor_parallel_size(self) -> int:
        return self.engine_args.get("tensor_parallel_size", 1)

    def rank_bundle(self) -> dict[str, float]:
        """What each tensor-parallel rank reserves (its placement-group bundle): the replica's CPUs and GPUs."""
        return {name: amount for name, amount in (("CPU", self.num_cpus_per_replica),
                                                  ("GPU", self.num_gpus_per_replica)) if amount}

    def placement(self) -> dict[str, Any]:
        """Serve's placement-group options for a replica: one bundle per tensor-parallel rank, all on one node
        (``STRICT_PACK``); the replica and its engine (rank 0) in bundle 0, with the replica's custom resources."""
        if self.tensor_parallel_size == 1:
            return {}
        first = {**self.rank_bundle(), **self.replica_resources}
        return {"placement_group_bundles": [first] + [self.rank_bundle()] * (self.tensor_parallel_size - 1),
                "placement_group_strategy": "STRICT_PACK"}

    @field_validator("autoscaling_config")
    @classmethod
    def _autoscaling_config_valid(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if value is None else with_llm_policy(value)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def router_config(self) -> RouterConfig:
        return RouterConfig(served_model_name=self.model_name, model=self.model, routing_policy=self.routing_policy,
                            max_pending_requests=self.max_pending_requests,
                            default_timeout_s=self.default_timeout_s, max_attempts=self.max_attempts,
                            max_migrations=self.max_migrations,
                            api_keys_file=self.api_keys_file, tenant_limits=self.tenant_limits,
                            default_tenant_limits=self.default_tenant_limits, body_timeout_s=self.body_timeout_s,
                            stream_channel=self.stream_channel,
                            max_requests_per_replica=self.max_ongoing_requests_per_replica)


def with_llm_policy(autoscaling_config: dict[str, Any]) -> dict[str, Any]:
    """``autoscaling_config`` with the engine-load policy filled in, checked as Serve will check it at deploy time.

    Serve's ``target_ongoing_requests`` is the default policy's knob; with the engine-load policy it would
    be silently ignored, so it is refused (the policy's own knob is ``policy_kwargs.target_load``), and so
    are keys Serve does not know (it would ignore them too).
    """
    from ray.serve.config import AutoscalingConfig  # Ray only where autoscaling is asked for

    config = dict(autoscaling_config)
    unknown = sorted(set(config) - set(AutoscalingConfig.model_fields))
    if unknown:  # Serve ignores unknown keys: a misspelt delay would silently keep its default
        raise ValueError(f"autoscaling_config has unknown keys {unknown}; Serve's are "
                         f"{sorted(k for k in AutoscalingConfig.model_fields if not k.startswith('_'))}")
    policy = dict(config.get("policy") or {})
    policy.setdefault("policy_function", POLICY_PATH)  # kwargs alone are the engine-load policy's
    config["policy"] = policy
    if policy.get("policy_function") == POLICY_PATH:
        if "target_ongoing_requests" in config:
            raise ValueError("autoscaling_config.target_ongoing_requests is ignored by the engine-load policy "
                             f"({POLICY_PATH}); set autoscaling_config.policy.policy_kwargs.target_load (0-1] "
                             "instead, or name Serve's policy in autoscaling_config.policy.policy_function")
        try:  # a bad kwarg fails here, not later in Serve's controller
            LLMLoadPolicy(**policy.get("policy_kwargs", {}))
        except TypeError as e:
            raise ValueError(f"autoscaling_config.policy.policy_kwargs: {e}") from None
    AutoscalingConfig.model_validate(config)
    return config
