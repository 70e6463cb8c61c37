"""The environment a Ray cluster serving inflight starts with: set before Ray starts (its processes read it once).

``RAY_SERVE_THROUGHPUT_OPTIMIZED=1`` is Ray Serve 2.60's bundle for high request rates: calls between
deployments over gRPC, each replica's user code and request routing on its main event loop rather than
threads of their own, the GC frozen after start-up. On the 2-core demo it took HTTP throughput at
64 streams from ~39% to ~53% of the engine's offline rate (``benchmarks.serving_overhead``, side by side
in docs/benchmarks.md): a replica's step thread then contends with one event-loop thread for the GIL,
not several. The bundle's direct ingress (each ingress replica serving HTTP on a port of its own, for an
HAProxy in front) stays off: clients reach Serve's proxy on the usual port.

Who applies it: ``scripts/serve.sh`` (``make run``), the test fixtures that start Ray, the serving
benchmarks, and ``k8s/Dockerfile`` (tests check the copies). (``RAY_AUTH_MODE=disabled``, for local
clusters only, is set by those local starters themselves, never in the image.)
"""

from __future__ import annotations

import os

SERVE_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
}


def apply(environ: dict[str, str] | None = None) -> None:
    """Set what is not set yet (a value the operator chose wins)."""
    environ = os.environ if environ is None else environ
    for key, value in SERVE_ENV.items():
        environ.setdefault(key, value)


if __name__ == "__main__":  # for shells: eval "$(python -m serve_app.ray_env)"
    for key, value in SERVE_ENV.items():
        print(f'export {key}="${{{key}:-{value}}}"')
