"""A client that leaves, and a request whose deadline passes, free their batch slot and KV blocks at once."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.serving.helpers import (
    assert_error_body,
    assert_schema,
    chat_body,
    completion_body,
    get_stats,
    post_stream,
    wait_idle,
)

pytestmark = pytest.mark.timeout(60, func_only=True)

LONG = {"max_tokens": 1900, "ignore_eos": True}  # ~7 s of decoding on 2 CPU cores: far longer than the checks below


def assert_freed_soon(base_url: str, seconds: float = 3.0) -> None:
    """/stats: every replica has nothing running or waiting and no KV block in use, within ``seconds``."""
    wait_idle(base_url, timeout=seconds)


@pytest.fixture(params=["proxy", "router"])
def entry(request, server) -> str:
    """Where a client reaches the app: Serve's proxy (a cluster's entry point) or the router's own port (the API
    port of `make run`); each notices a client that hangs up its own way."""
    return server if request.param == "proxy" else request.getfixturevalue("demo_router")


@pytest.mark.parametrize("path, make", [("/v1/completions", completion_body), ("/v1/chat/completions", chat_body)],
                         ids=["completions", "chat"])
def test_client_disconnect_mid_stream_frees_the_engine(entry, server, path, make):
    body = {**make(**LONG), "stream": True}
    with httpx.Client(timeout=30) as client, client.stream("POST", entry + path, json=body) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            if line.startswith("data: "):
                events += 1
            if events == 4:
                # Still connected: the request holds a batch slot and KV blocks.
                replica = get_stats(server)["replicas"][0]
                assert replica["num_running"] == 1 and replica["kv_blocks_used"] > 0, replica
                break
        assert events == 4
    # Leaving the `with` closed the connection mid-stream.
    started = time.monotonic()
    assert_freed_soon(server, seconds=3.0)
    assert time.monotonic() - started < 3.0


def test_client_gives_up_on_non_streaming_request_frees_the_engine(entry, server):
    """A non-streaming client that times out (closes the connection) must not leave the request generating."""
    with httpx.Client(timeout=httpx.Timeout(30.0, read=1.0)) as client, pytest.raises(httpx.ReadTimeout):
        client.post(entry + "/v1/completions", json=completion_body(**LONG))
    assert_freed_soon(server, seconds=3.0)


def test_timeout_non_streaming_is_504(client, server):
    started = time.monotonic()
    response = client.post("/v1/completions", json=completion_body(timeout=0.3, **LONG))
    elapsed = time.monotonic() - started
    error = assert_error_body(response, 504, "timeout")
    assert error["code"] == "timeout", error
    assert elapsed < 3.0, f"a 0.3 s deadline took {elapsed:.1f} s to answer"
    assert_freed_soon(server)


def test_timeout_chat_non_streaming_is_504(client, server):
    assert_error_body(client.post("/v1/chat/completions", json=chat_body(timeout=0.3, **LONG)), 504, "timeout")
    assert_freed_soon(server)


@pytest.mark.parametrize("path, make", [("/v1/completions", completion_body), ("/v1/chat/completions", chat_body)],
                         ids=["completions", "chat"])
def test_timeout_streaming_ends_with_error_event_then_done(client, server, path, make):
    started = time.monotonic()
    response, stream = post_stream(client, path, make(timeout=0.3, **LONG))
    elapsed = time.monotonic() - started
    assert response.status_code == 200  # the stream had started: the error comes in-band
    assert stream.done, "the stream must still end with [DONE]"
    assert len(stream.errors) == 1 and stream.events[-1] is stream.errors[0], stream.raw[-600:]
    assert_schema("ErrorResponse", stream.errors[0])
    assert stream.errors[0]["error"]["type"] == "timeout"
    assert elapsed < 3.0, f"a 0.3 s deadline took {elapsed:.1f} s to end the stream"
    assert_freed_soon(server)


def test_server_serves_after_cancellations(client):
    response = client.post("/v1/completions", json=completion_body(max_tokens=5, ignore_eos=True))
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5
