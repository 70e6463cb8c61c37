"""One Ray cluster and one deployed demo app for the serving and security suites (Ray start-ups are expensive):
a pytest plugin (``pytest_plugins`` in tests/conftest.py), so both directories share the one session cluster.

``ray_cluster`` (session): a fresh local Ray (never an existing one), metrics exported on :8080,
Serve's HTTP proxy on 127.0.0.1:8000. ``demo_app`` (session): the demo-tiny app at ``/``.
Other apps (the 2-replica one) are deployed next to it, under their own name and route prefix,
by ``deploy_app`` and deleted when their tests end.

Every fixture bounds its own waiting (deadlines below); tests carry ``pytest.mark.timeout`` marks
with ``func_only=True``, so the session's start-up is never charged to whichever test comes first.
"""

from __future__ import annotations

import os

os.environ["RAY_AUTH_MODE"] = "disabled"  # Ray >= 2.59 turns token auth on for local clusters


import httpx
import pytest

from inflight.serve_app.ports import wait_for_router_url
from tests.serving.apps import DEMO_APP_ARGS, deploy_app
from tests.serving.helpers import HOST, HTTP_PORT, METRICS_PORT, port_free, wait_idle

DEFAULT_TEST_TIMEOUT_S = 60
DEMO_APP_NAME = "inflight"
RAY_NUM_CPUS = 4  # logical CPUs: the demo replica takes 1, the 2-replica app 2 x 0.5; routers and proxy 0


def pytest_collection_modifyitems(config, items):
    """A hard bound for every serving and security test, even one written without its own mark."""
    for item in items:
        path = str(item.fspath)
        if ("tests/serving" in path or "tests/security" in path) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(DEFAULT_TEST_TIMEOUT_S, func_only=True))


@pytest.fixture(scope="session")
def ray_cluster():
    import ray
    from ray import serve

    for port in (HTTP_PORT, METRICS_PORT):
        if not port_free(port):
            pytest.fail(f"port {port} on {HOST} is taken (another `serve run`/`ray start`?); the serving tests need it",
                        pytrace=False)
    # address="local": always a new cluster, never one found through RAY_ADDRESS or a running `ray start`.
    ray.init(address="local", num_cpus=RAY_NUM_CPUS, include_dashboard=False, _metrics_export_port=METRICS_PORT,
             log_to_driver=False, configure_logging=False)
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": HOST, "port": HTTP_PORT})
        yield ray
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(scope="session")
def demo_app(ray_cluster) -> str:
    """Base URL of the shared demo-tiny app (route prefix ``/``)."""
    return deploy_app(DEMO_APP_ARGS, name=DEMO_APP_NAME, route_prefix="/")


@pytest.fixture
def server(demo_app) -> str:
    """The demo app, idle: no request of an earlier test still running, waiting or holding KV blocks."""
    wait_idle(demo_app, timeout=30.0)
    return demo_app


@pytest.fixture
def demo_router(server) -> str:
    """The same demo app, idle, on its router's own port (Serve's direct ingress: what `make run` serves on :8000)
    rather than through Serve's proxy."""
    return wait_for_router_url(DEMO_APP_NAME, HOST)


@pytest.fixture
def client(server):
    with httpx.Client(base_url=server, timeout=60.0) as c:
        yield c

