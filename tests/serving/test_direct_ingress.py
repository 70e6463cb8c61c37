"""The router's own HTTP port (Serve's direct ingress): the API ``make run`` serves on :8000.

The test cluster keeps Serve's proxy on :8000 (the other serving tests go through it, as a cluster's clients do)
and starts Ray with the same settings as ``make run`` otherwise, so each router also serves on a port of its own
(``serve_app.ports``). Here the shared demo app is driven on that port: the same answers as through the proxy,
the same errors (a client that leaves it frees its request: test_cancellation, on both entry points).
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from tests.serving.helpers import HOST, SSEStream, assert_error_body, completion_body, parse_sse

pytestmark = pytest.mark.timeout(90, func_only=True)


def _stream(client: httpx.Client, url: str, body: dict) -> SSEStream:
    with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        return parse_sse(response.read().decode())


def test_the_router_port_answers_as_the_proxy_does(server, demo_router):
    body = completion_body(max_tokens=12, temperature=0, ignore_eos=True)
    with httpx.Client(timeout=60) as client:
        assert client.get(demo_router + "/v1/models").json()["data"][0]["id"] == body["model"]
        through_proxy = client.post(server + "/v1/completions", json=body).json()["choices"][0]["text"]
        direct = client.post(demo_router + "/v1/completions", json=body).json()
        streamed = _stream(client, demo_router, body)
    assert direct["choices"][0]["text"] == through_proxy
    assert direct["usage"]["completion_tokens"] == 12
    assert streamed.done and streamed.text() == through_proxy


def test_bad_input_on_the_router_port_is_a_400_with_the_error_body(demo_router):
    with httpx.Client(timeout=60) as client:
        response = client.post(demo_router + "/v1/completions", json=completion_body(max_tokens=-1))
        not_json = client.post(demo_router + "/v1/completions", content=b"{not json",
                               headers={"content-type": "application/json"})
    assert assert_error_body(response, 400)["param"] == "max_tokens"
    assert_error_body(not_json, 400)


def _port_in_time_wait() -> int:
    """A port whose listener is gone but whose server side closed a connection: it lingers in TIME_WAIT. The
    listener reused addresses, as a router with the hook did, and as Serve's proxy does."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((HOST, 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection((HOST, port))
    accepted, _ = listener.accept()
    accepted.close()  # the server closes first: its end goes to TIME_WAIT
    client.recv(1)
    client.close()
    listener.close()
    return port


def test_a_restarted_router_binds_its_port_over_the_last_ones_closed_connections():
    from ray.serve._private import replica as serve_replica
    from ray.serve.config import HTTPOptions

    from inflight.serve_app.ports import reclaim_own_port_at_restart

    port = _port_in_time_wait()
    plain = socket.socket()
    with pytest.raises(OSError):  # how Serve binds a router's port: refused for the next minute
        plain.bind((HOST, port))
    plain.close()

    async def serve_once() -> int:
        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        task, server = await serve_replica.start_asgi_http_server(app, HTTPOptions(host=HOST, port=port),
                                                                  event_loop=asyncio.get_running_loop())
        async with httpx.AsyncClient() as client:
            status = (await client.get(f"http://{HOST}:{port}/")).status_code
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        return status

    assert reclaim_own_port_at_restart()  # as the router's constructor does, before Serve starts its server
    assert asyncio.run(serve_once()) == 204
