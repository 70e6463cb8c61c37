"""The environment a Ray cluster serving inflight starts with: set before Ray starts (its processes read it once).

``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` is Ray Serve 2.60's bundle for high request rates: calls between
deployments over gRPC, each replica's user code and request routing on its main event loop rather than
threads of their own, the GC frozen after start-up. On the 2-core demo it took HTTP throughput at
64 streams from ~39% to ~53% of the engine's offline rate (``benchmarks.serving_overhead``, side by side
in docs/benchmarks-history.md): a replica's step thread then contends with one event-loop thread for the GIL,
not several.

``RAY_SERVE_ENABLE_DIRECT_INGRESS=1`` (the bundle's default, kept): each ingress replica, our ``Router``, also
serves HTTP itself, on a port of its own, beside Serve's proxy. A request that comes to the router's port skips
the proxy's process and its hop: on the 2-core demo 36-53% more output tokens/s at 64 streams and a first token
~9 ms sooner (docs/benchmarks-history.md). Without that port a request costs the proxy's process its HTTP
parsing and a Ray call, and the router a call back to the proxy for the request's body and disconnect.

``LOCAL_SERVE_ENV`` adds what one machine's ``make run`` wants on top: the router's port is the API port,
:8000 (the range Serve allocates ingress ports from starts there), and a restarted router gets it back at once
(no quarantine of released ports: that is for an HAProxy in front, which a single machine does not have). The
local configs put Serve's proxy on :8100 (``http_options.port``): it serves the same API, for tools that expect
Serve's own routes (``/-/healthz``, ``/-/routes``). A cluster (KubeRay) keeps the proxy as its entry point on
:8000, one per node behind the Service; its routers' own ports (30000 up) stay inside the pods.

Who applies it: ``scripts/serve.sh`` (``make run``: both), ``inflight serve`` (``serve_app/cli.py``: both), the
test fixtures that start Ray and ``k8s/Dockerfile`` (``SERVE_ENV``; tests check the copies), the serving benchmarks
(as ``make run``). (``RAY_AUTH_MODE=disabled``, for local clusters only, is set by those local starters
themselves, never in the image.)
"""

from __future__ import annotations

import os
import sys

API_PORT = 8000  # make run's API: the router's own port
LOCAL_PROXY_PORT = 8100  # Serve's proxy in the local configs (http_options.port)

SERVE_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    # A stopping ingress replica otherwise stays up 30 s more than its requests need, for a load balancer in front
    # of the routers' own ports to notice; ours have none (locally a client reaches the one router; on a cluster,
    # the proxies), so a router's drain waits for its requests only, as without direct ingress.
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
}
LOCAL_SERVE_ENV = {
    **SERVE_ENV,
    "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(API_PORT),
    "RAY_SERVE_PORT_QUARANTINE_S": "0",
}


def serve_env(local: bool = False) -> dict[str, str]:
    """The settings: a cluster's, or (``local``) one machine's ``make run``."""
    return LOCAL_SERVE_ENV if local else SERVE_ENV


def apply(environ: dict[str, str] | None = None, local: bool = False) -> None:
    """Set what is not set yet (a value the operator chose wins); ``local``: one machine's ``make run``.

    Raises ``RuntimeError`` when this process has already imported Serve's constants without these settings:
    they are read once, at import, and a handle this process makes would carry the old ones into the cluster
    (a benchmark that did so measured Ray's by-reference calls between router and replica, not the gRPC
    calls that ``make run``'s app makes)."""
    environ = os.environ if environ is None else environ
    for key, value in serve_env(local).items():
        environ.setdefault(key, value)
    constants = sys.modules.get("ray.serve._private.constants")
    if environ is os.environ and constants is not None and not constants.RAY_SERVE_THROUGHPUT_OPTIMIZED \
            and environ.get("RAY_SERVE_THROUGHPUT_OPTIMIZED") == "1":
        raise RuntimeError("serve_app.ray_env.apply() came after ray.serve was imported: apply it first, before "
                           "anything imports ray.serve")


if __name__ == "__main__":  # for shells: eval "$(python -m serve_app.ray_env [--local])"
    for key, value in serve_env("--local" in sys.argv[1:]).items():
        print(f'export {key}="${{{key}:-{value}}}"')
