"""The application builder and the shipped config files (no Ray cluster needed: building an app is lazy)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ray.serve import Application
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.config import AutoscalingConfig
from ray.serve.schema import ServeDeploySchema
from ray.serve.scripts import convert_args_to_dict

from inflight.serve_app.app import build_app
from inflight.serve_app.config import AppConfig

pytestmark = pytest.mark.timeout(60)

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def serve_run_args(*cli_args: str):
    """What ``serve run inflight.serve_app.app:build_app key=value ...`` does with its arguments."""
    return call_user_app_builder_with_args_if_necessary(build_app, convert_args_to_dict(cli_args))


def test_serve_run_style_args_build_an_app():
    app = serve_run_args("model=demo-tiny", "num_replicas=2", "routing_policy=round_robin", "max_pending_requests=10")
    assert isinstance(app, Application)
    config = AppConfig.model_validate(convert_args_to_dict(("model=demo-tiny", "num_replicas=2")))
    assert config.num_replicas == 2 and config.model_name == "demo-tiny"


def test_serve_run_style_no_args_is_the_default_app():
    assert isinstance(serve_run_args(), Application)


@pytest.mark.parametrize("cli_arg, named", [
    ("routing_policy=fastest", "routing_policy"),
    ("num_replicas=lots", "num_replicas"),
    ("num_replicas=0", "num_replicas"),
    ("max_pending_requests=0", "max_pending_requests"),
    ("default_timeout_s=-1", "default_timeout_s"),
    ("no_such_option=1", "no_such_option"),
])
def test_serve_run_style_bad_args_name_the_argument(cli_arg, named):
    with pytest.raises(ValueError, match=named):
        serve_run_args("model=demo-tiny", cli_arg)


@pytest.mark.parametrize("engine_args, named", [
    ({"max_num_seqz": 8}, "max_num_seqz"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"block_size": 12}, "block_size"),
    ({"dtype": "int3"}, "dtype"),
    ({"model": "demo-tiny"}, "model"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 99}}, "num_speculative_tokens"),
    ({"speculative_config": {"method": "draft"}}, "draft_model"),
])
def test_bad_engine_args_raise_value_error_naming_them(engine_args, named):
    with pytest.raises(ValueError, match=named):
        AppConfig(model="demo-tiny", engine_args=engine_args)
    with pytest.raises(ValueError, match=named):
        build_app({"model": "demo-tiny", "engine_args": engine_args})


def test_router_config_carries_the_app_settings():
    config = AppConfig(model="/ckpt/llama", served_model_name="llama", max_pending_requests=7, default_timeout_s=3,
                       max_attempts=2)
    router = config.router_config()
    assert (router.served_model_name, router.max_pending_requests, router.default_timeout_s, router.max_attempts) == \
        ("llama", 7, 3.0, 2)
    assert AppConfig(model="demo-tiny").router_config().served_model_name == "demo-tiny"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_file_validates_against_serve_schema_and_app_config(path):
    raw = yaml.safe_load(path.read_text())
    schema = ServeDeploySchema.model_validate(raw)  # Ray's own schema for `serve run` / `serve deploy` files
    assert schema.applications, f"{path.name} has no application"
    for app in schema.applications:
        module, _, attr = app.import_path.partition(":")
        builder = getattr(importlib.import_module(module), attr)
        assert builder is build_app, app.import_path
        config = AppConfig.model_validate(app.args)  # raises naming any bad argument
        if config.autoscaling_config:
            AutoscalingConfig.model_validate(config.autoscaling_config)  # what Serve will check at deploy time
        assert isinstance(call_user_app_builder_with_args_if_necessary(builder, dict(app.args)), Application)


def test_configs_exist():
    assert {p.name for p in CONFIGS} >= {"demo.yaml", "demo-multi.yaml"}


CLUSTER_CONFIGS = ("gpu-llama.yaml", "gpu-tp2.yaml")  # the RayServices' (k8s/)
LOCAL_CONFIGS = [p for p in CONFIGS if p.name not in CLUSTER_CONFIGS]


@pytest.mark.parametrize("path", LOCAL_CONFIGS, ids=[p.name for p in LOCAL_CONFIGS])
def test_a_local_config_leaves_the_api_port_to_its_router(path):
    """`make run` serves the API from the router itself on API_PORT (serve_app/ray_env.py); Serve's proxy, which
    starts first, must not hold that port, or the router would take the next one and :8000 would be the proxy's."""
    from inflight.serve_app.ray_env import API_PORT, LOCAL_PROXY_PORT, LOCAL_SERVE_ENV

    raw = yaml.safe_load(path.read_text())
    assert raw["http_options"]["port"] == LOCAL_PROXY_PORT != API_PORT
    assert int(LOCAL_SERVE_ENV["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"]) == API_PORT
    assert LOCAL_SERVE_ENV["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    routers = [app.get("args", {}).get("router_replicas", 1) for app in raw["applications"]]
    assert routers == [1], "one router, on the one API port (more need a load balancer in front)"


@pytest.mark.parametrize("name", CLUSTER_CONFIGS)
def test_a_cluster_config_keeps_serves_proxy_on_the_service_port(name):
    raw = yaml.safe_load((CONFIGS[0].parent / name).read_text())
    assert raw["http_options"]["port"] == 8000  # KubeRay's serve Service targets the proxy there (k8s/)


def _python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}  # as a fresh shell has it
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=Path(__file__).parents[2], capture_output=True,
                          text=True, timeout=120)


def test_serve_settings_applied_after_ray_serve_is_imported_are_refused():
    """Serve reads its settings once, at import, and a handle made in that process keeps them: applied too late,
    the app's router would call its replicas the way make run's does not (by reference rather than by gRPC)."""
    late = _python("import ray.serve\nfrom inflight.serve_app import ray_env\nray_env.apply(local=True)")
    assert late.returncode != 0 and "apply it first" in late.stderr
    early = _python("from inflight.serve_app import ray_env\nray_env.apply(local=True)\n"
                    "from ray.serve._private.handle_options import DynamicHandleOptions\n"
                    "assert not DynamicHandleOptions()._by_reference")
    assert early.returncode == 0, early.stderr
