"""Where an application's routers answer HTTP themselves (Serve's direct ingress, ``serve_app/ray_env.py``).

Each router replica serves the API on a port of its own beside Serve's proxy, on the host of Serve's
``http_options``; Serve's controller allocates the ports and keeps them in the "target groups" it gives a load
balancer in front. ``make run`` needs none of this (its one router takes :8000); tests and benchmarks that
deploy several applications in one cluster ask here.
"""

from __future__ import annotations

import time


def router_ports(app_name: str) -> list[int]:
    """The HTTP port of each running router replica of ``app_name``; empty while none has its port yet."""
    import ray
    from ray.serve._private.common import RequestProtocol
    from ray.serve.context import _get_global_client

    controller = _get_global_client()._controller  # Serve's own record; no public API reads it in Ray 2.60
    groups = ray.get(controller.get_target_groups.remote())  # every application's (asking for one it lacks raises)
    return [target.port for group in groups
            if group.protocol == RequestProtocol.HTTP and group.app_name == app_name for target in group.targets]


def wait_for_router_port(app_name: str, timeout_s: float = 60.0) -> int:
    """The first router replica's port, once it serves; ``TimeoutError`` if none does within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        ports = router_ports(app_name)
        if ports:
            return ports[0]
        if time.monotonic() > deadline:
            raise TimeoutError(f"no router of application {app_name!r} served HTTP within {timeout_s:.0f} s")
        time.sleep(0.2)
