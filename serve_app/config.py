"""The application's arguments: pydantic at the edge (serve config files, ``serve run ... key=value``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.config import EngineConfig


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    served_model_name: str
    max_pending_requests: int = Field(default=256, ge=1)  # in flight through one router; more get 429
    default_timeout_s: float = Field(default=120.0, gt=0)  # deadline when a request brings no `timeout`
    max_attempts: int = Field(default=3, ge=1)  # tries of a request whose replica died before it started


class AppConfig(BaseModel):
    """Everything ``build_app`` takes. Engine arguments are checked by the engine's own ``EngineConfig``."""

    model_config = ConfigDict(extra="forbid")

    model: str = "demo-tiny"
    served_model_name: str | None = None
    engine_args: dict[str, Any] = Field(default_factory=dict)
    num_replicas: int | Literal["auto"] = 1
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
    routing_policy: Literal["least_loaded", "power_of_two", "round_robin", "prefix_affinity"] = "least_loaded"
    routing_stats_period_s: float = Field(default=0.5, gt=0)
    router_replicas: int = Field(default=1, ge=1)

    @field_validator("engine_args")
    @classmethod
    def _engine_args_valid(cls, value: dict[str, Any]) -> dict[str, Any]:
        EngineConfig.from_kwargs(**value)  # raises ValueError naming a bad argument, before anything starts
        if "model" in value:
            raise ValueError("set the model with the top-level `model`, not inside engine_args")
        return value

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def router_config(self) -> RouterConfig:
        return RouterConfig(served_model_name=self.model_name, max_pending_requests=self.max_pending_requests,
                            default_timeout_s=self.default_timeout_s, max_attempts=self.max_attempts)
