"""The router's own HTTP port (Serve's direct ingress): the API ``make run`` serves on :8000.

The test cluster keeps Serve's proxy on :8000 (the other serving tests go through it, as a cluster's clients do)
and starts Ray with the same settings as ``make run`` otherwise, so each router also serves on a port of its own
(``serve_app.ingress``). Here the shared demo app is driven on that port: the same answers as through the proxy,
the same errors (a client that leaves it frees its request: test_cancellation, on both entry points).
"""

from __future__ import annotations

import httpx
import pytest

from serve_app.ingress import wait_for_router_port
from tests.serving.helpers import HOST, SSEStream, assert_error_body, completion_body, parse_sse

pytestmark = pytest.mark.timeout(90, func_only=True)


@pytest.fixture
def router_url(server) -> str:
    return f"http://{HOST}:{wait_for_router_port('inflight')}"


def _stream(client: httpx.Client, url: str, body: dict) -> SSEStream:
    with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        return parse_sse(response.read().decode())


def test_the_router_port_answers_as_the_proxy_does(server, router_url):
    body = completion_body(max_tokens=12, temperature=0, ignore_eos=True)
    with httpx.Client(timeout=60) as client:
        assert client.get(router_url + "/v1/models").json()["data"][0]["id"] == body["model"]
        through_proxy = client.post(server + "/v1/completions", json=body).json()["choices"][0]["text"]
        direct = client.post(router_url + "/v1/completions", json=body).json()
        streamed = _stream(client, router_url, body)
    assert direct["choices"][0]["text"] == through_proxy
    assert direct["usage"]["completion_tokens"] == 12
    assert streamed.done and streamed.text() == through_proxy


def test_bad_input_on_the_router_port_is_a_400_with_the_error_body(router_url):
    with httpx.Client(timeout=60) as client:
        response = client.post(router_url + "/v1/completions", json=completion_body(max_tokens=-1))
        not_json = client.post(router_url + "/v1/completions", content=b"{not json",
                               headers={"content-type": "application/json"})
    assert assert_error_body(response, 400)["param"] == "max_tokens"
    assert_error_body(not_json, 400)

