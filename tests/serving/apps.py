"""Deploying the apps the serving tests talk to (real ``make_app`` + ``serve.run_many``), with bounded waits."""

from __future__ import annotations

import time
from typing import Any

import httpx

from tests.serving.helpers import BASE_URL

DEPLOY_TIMEOUT_S = 120.0

# The demo app every test shares. Small admission bounds so overload is reachable with a few hundred
# requests; a small KV pool (256 blocks of 16 = 4096 tokens, room for two max_model_len requests) so a
# test can force preemption with three long requests.
DEMO_APP_ARGS: dict[str, Any] = {
    "model": "demo-tiny",
    # With speculative decoding (n-gram lookup; demo-tiny's greedy output repeats itself, so proposals are made and
    # accepted): every serving test of this app runs through verification steps that emit several tokens at once.
    # Not adaptive: adaptive speculation sizes proposals from measured step costs, so on a busy machine it could
    # propose nothing and the metrics test would see no accepted token. The 2-replica app decodes plainly.
    "engine_args": {"max_model_len": 2048, "max_num_seqs": 32, "num_threads": 1, "num_kv_blocks": 256,
                    "speculative_config": {"method": "ngram", "adaptive": False}},
    "num_replicas": 1,
    "num_cpus_per_replica": 1,
    "max_pending_requests": 48,
    # Above max_pending_requests, so the router's bound is the one a burst meets: with the replica's lower,
    # the replica's quick 429s could keep the router under its own bound (a race the metrics test lost once).
    "max_queued_requests_per_replica": 64,
    "default_timeout_s": 60,
}


def deploy_app(args: dict[str, Any], name: str, route_prefix: str, timeout: float = DEPLOY_TIMEOUT_S,
               http_base: str = BASE_URL, headers: dict[str, str] | None = None) -> str:
    """Deploy ``make_app(AppConfig(**args))`` under ``name`` at ``route_prefix``; return its base URL once it answers.

    ``http_base``: where Serve's proxy listens (the multi-node tests use a port of their own); ``headers``: sent
    with the readiness probe (an API key).
    """
    from ray import serve

    from inflight.serve_app.app import make_app
    from inflight.serve_app.config import AppConfig

    app = make_app(AppConfig(**args), engine_cls=None)
    serve.run_many([serve.RunTarget(target=app, name=name, route_prefix=route_prefix)],
                   wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
    deadline = time.monotonic() + timeout
    while True:
        status = serve.status().applications.get(name)
        if status is not None and status.status == "RUNNING":
            break
        if status is not None and status.status in ("DEPLOY_FAILED", "UNHEALTHY"):
            raise RuntimeError(f"app {name!r} failed to deploy: {status.status} {status.message} "
                               f"{ {k: (d.status, d.message) for k, d in status.deployments.items()} }")
        if time.monotonic() > deadline:
            raise RuntimeError(f"app {name!r} not RUNNING after {timeout}s: {status}")
        time.sleep(0.5)
    base_url = http_base + route_prefix.rstrip("/")
    while True:  # the proxy learns the new route a moment after the app is RUNNING
        try:
            if httpx.get(base_url + "/v1/models", timeout=5.0, headers=headers).status_code == 200:
                return base_url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"app {name!r} is RUNNING but {base_url}/v1/models does not answer")
        time.sleep(0.3)


def delete_app(name: str, timeout: float = 60.0) -> None:
    """``serve.delete``, waiting at most ``timeout`` seconds for the app to be gone."""
    from ray import serve

    serve.delete(name, _blocking=False)
    deadline = time.monotonic() + timeout
    while name in serve.status().applications:
        if time.monotonic() > deadline:
            raise RuntimeError(f"app {name!r} still present {timeout}s after serve.delete")
        time.sleep(0.5)
