"""The engine-load autoscaling policy as pure functions, and how AppConfig fills and checks it (no Ray cluster)."""

from __future__ import annotations

import math

import pytest
from ray.serve.config import AutoscalingConfig

from inflight.serve_app.autoscaling import (LOAD_METRIC, POLICY_PATH, SLOTS_METRIC, LLMLoadPolicy, autoscaling_metrics,
                                   desired_replicas, replica_load)
from inflight.serve_app.config import AppConfig


def stats(running=0, waiting=0, slots=4, kv_used=0, kv_total=100):
    return {"num_running": running, "num_waiting": waiting, "max_num_seqs": slots, "kv_blocks_used": kv_used,
            "kv_blocks_total": kv_total}


def test_load_is_requests_per_batch_slot():
    assert replica_load(stats()) == 0.0
    assert replica_load(stats(running=2, slots=4, kv_used=10)) == 0.5
    assert replica_load(stats(running=4, waiting=8, slots=4, kv_used=40)) == 3.0


def test_load_sees_a_kv_bound_replica_with_free_slots():
    """Long prompts: 4 of 256 slots used but the KV cache 90% full, 2 more waiting: saturated, not idle."""
    load = replica_load(stats(running=4, waiting=2, slots=256, kv_used=90))
    assert load == pytest.approx(0.9 * 6 / 4)
    assert load > 1.0 > (4 + 2) / 256


def test_reported_metrics_are_plain_numbers():
    metrics = autoscaling_metrics(stats(running=1, slots=4))
    assert metrics == {LOAD_METRIC: 0.25, SLOTS_METRIC: 4.0}
    assert all(type(v) is float for v in metrics.values())  # Serve drops custom metrics that are not numbers


def test_desired_replicas():
    # One full replica at target 0.8 wants 1.25 (Serve rounds up to 2); two half-loaded ones want 1.25 too.
    assert desired_replicas([1.0], [4], 0, 1, 0.8) == pytest.approx(1.25)
    assert desired_replicas([0.5, 0.5], [4, 4], 0, 2, 0.8) == pytest.approx(1.25)
    # Idle: zero (Serve keeps min_replicas). Nothing reported yet: stay where we are.
    assert desired_replicas([0.0, 0.0], [4, 4], 0, 2, 0.8) == 0
    assert desired_replicas([], [], 0, 3, 0.8) == 3
    # Requests Serve holds at handles count against an average replica's slots: 8 over 4 slots = 2 replicas' load.
    assert desired_replicas([1.0], [4], 8, 1, 1.0) == pytest.approx(3.0)
    assert math.ceil(desired_replicas([3.0], [4], 0, 1, 0.8)) == 4  # the overloaded test replica: capped by max


class Context:
    """The fields of Serve's AutoscalingContext the policy reads."""

    def __init__(self, loads, slots, queued=0.0, num_running=1):
        self.aggregated_metrics = {LOAD_METRIC: dict(enumerate(loads)), SLOTS_METRIC: dict(enumerate(slots))}
        self.total_queued_requests = queued
        self.current_num_replicas = num_running


def test_policy_reads_serves_context():
    policy = LLMLoadPolicy(target_load=0.5)
    assert policy(Context([0.5, 0.5], [4, 4], num_running=2)) == (pytest.approx(2.0), {})
    assert policy(Context([], [], num_running=2)) == (2.0, {})


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, "high", True])
def test_policy_refuses_a_bad_target(bad):
    with pytest.raises(ValueError, match="target_load"):
        LLMLoadPolicy(target_load=bad)


def test_app_config_fills_in_the_engine_load_policy():
    config = AppConfig(autoscaling_config={"min_replicas": 1, "max_replicas": 3})
    assert config.autoscaling_config["policy"] == {"policy_function": POLICY_PATH}
    parsed = AutoscalingConfig.model_validate(config.autoscaling_config)
    assert parsed.policy.policy_function == POLICY_PATH and not parsed.policy.is_default_policy_function()
    config = AppConfig(autoscaling_config={"max_replicas": 3, "policy": {"policy_kwargs": {"target_load": 0.6}}})
    assert config.autoscaling_config["policy"] == {"policy_function": POLICY_PATH, "policy_kwargs": {"target_load": 0.6}}
    # Serve's own policy stays available by name, with its own knob.
    serve_default = {"policy_function": "ray.serve.autoscaling_policy:replica_queue_length_autoscaling_policy"}
    config = AppConfig(autoscaling_config={"max_replicas": 3, "target_ongoing_requests": 64, "policy": serve_default})
    assert config.autoscaling_config["target_ongoing_requests"] == 64


@pytest.mark.parametrize("autoscaling_config, named", [
    ({"max_replicas": 2, "target_ongoing_requests": 64}, "target_ongoing_requests"),
    ({"max_replicas": 2, "policy": {"policy_function": POLICY_PATH, "policy_kwargs": {"target_lod": 0.5}}},
     "target_lod"),
    ({"max_replicas": 2, "policy": {"policy_function": POLICY_PATH, "policy_kwargs": {"target_load": 2}}},
     "target_load"),
    ({"min_replicas": 3, "max_replicas": 2}, "min_replicas"),
    ({"max_replicas": 2, "upscale_delay": 1}, "upscale_delay"),
])
def test_bad_autoscaling_config_names_the_problem(autoscaling_config, named):
    with pytest.raises(ValueError, match=named):
        AppConfig(autoscaling_config=autoscaling_config)
