"""Where an application's routers answer HTTP themselves (Serve's direct ingress, ``serve_app/ray_env.py``).

Each router replica serves the API on a port of its own beside Serve's proxy, on the host of Serve's
``http_options``; Serve's controller allocates the ports and keeps them in the "target groups" it gives a load
balancer in front. ``make run`` needs none of this (its one router takes :8000); tests and benchmarks that
deploy several applications in one cluster ask here.
"""

from __future__ import annotations

import socket
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


def wait_for_router_url(app_name: str, host: str, timeout_s: float = 60.0) -> str:
    """``http://host:port`` of the first router replica, once it serves (``host``: Serve's ``http_options``'); a
    ``TimeoutError`` if none does within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        ports = router_ports(app_name)
        if ports:
            return f"http://{host}:{ports[0]}"
        if time.monotonic() > deadline:
            raise TimeoutError(f"no router of application {app_name!r} served HTTP within {timeout_s:.0f} s")
        time.sleep(0.2)


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether nothing listens on ``host:port`` (taken, Serve would give a router the next free port instead)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def reclaim_own_port_at_restart() -> bool:
    """Let this process's router take its HTTP port back while the last one's closed connections linger.

    Serve binds an ingress replica's own port without ``SO_REUSEADDR``. A server that closes connections (idle
    keep-alives, a shutdown) leaves them in TIME_WAIT on its port for a minute, so a router restarted in that
    minute (after a crash, a redeploy) found :8000 taken and Serve gave it the next free port: the API moved.
    Serve's own proxy binds with ``SO_REUSEADDR``/``SO_REUSEPORT`` (its ``enable_so_reuseport``); this asks the
    same for the router's server. Called by the router before Serve starts that server (which it does once the
    replica's constructor has returned). Returns False, changing nothing, if this Ray has no such function.
    """
    from ray.serve._private import replica as serve_replica

    start = getattr(serve_replica, "start_asgi_http_server", None)
    if start is None or getattr(start, "reclaims_port", False):
        return start is not None

    async def start_reusing_port(app, http_options, *, event_loop, enable_so_reuseport: bool = False):
        return await start(app, http_options, event_loop=event_loop, enable_so_reuseport=True)

    start_reusing_port.reclaims_port = True
    serve_replica.start_asgi_http_server = start_reusing_port
    return True
