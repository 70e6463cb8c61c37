"""The inputs that have hurt the peers (issue 16, acceptance 2), against the running demo app: each gets a 4xx,
never a 5xx; afterwards /health answers, a normal request succeeds, every KV block is back and no replica
restarted."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.serving.helpers import HOST, HTTP_PORT, MODEL, get_stats, wait_idle

pytestmark = pytest.mark.timeout(180, func_only=True)

C, CHAT = "/v1/completions", "/v1/chat/completions"
VALUES = [-1, 0, 2 ** 31, 2 ** 63, "5", "many", 1.5, None]


def comp(**kw):
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 3, **kw}


def numeric_cases():
    for name in ("n", "best_of", "logprobs", "max_tokens"):
        for value in VALUES:
            yield f"completion-{name}={value!r}", C, json.dumps(comp(**{name: value})).encode()
    for value in VALUES:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True,
                "top_logprobs": value}
        yield f"chat-top_logprobs={value!r}", CHAT, json.dumps(body).encode()


RAW_CASES = [
    ("prompt-empty-list", C, json.dumps(comp(prompt=[])).encode()),
    ("prompt-list-of-empty-list", C, json.dumps(comp(prompt=[[]])).encode()),
    ("prompt-1e6-token-ids", C, json.dumps(comp(prompt=[7] * 1_000_000)).encode()),
    ("prompt-1MB-of-NUL", C, json.dumps(comp(prompt="\u0000" * (1 << 20))).encode()),
    ("prompt-lone-surrogate", C, b'{"model": "demo-tiny", "prompt": "a\\ud800b", "max_tokens": 3}'),
    ("chat-lone-surrogate", CHAT, b'{"model": "demo-tiny", "messages": [{"role": "user", "content": "\\udfff"}]}'),
    ("temperature-NaN", C, b'{"model": "demo-tiny", "prompt": "a", "temperature": NaN}'),
    ("temperature-Infinity", C, b'{"model": "demo-tiny", "prompt": "a", "temperature": Infinity}'),
    ("top_p-0", C, json.dumps(comp(top_p=0)).encode()),
    ("top_p-1.5", C, json.dumps(comp(top_p=1.5)).encode()),
    ("nested-1e5-deep", C, b'{"model": "demo-tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("duplicate-keys", C, b'{"model": "demo-tiny", "prompt": "a", "max_tokens": 2, "max_tokens": -5}'),
    ("body-20MB", C, json.dumps(comp(prompt="a" * (20 << 20))).encode()),
    ("prompt_logprobs-minus-1", C, json.dumps(comp(echo=True, logprobs=-1, max_tokens=0)).encode()),
]
CASES = list(numeric_cases()) + RAW_CASES


@pytest.fixture(scope="module")
def before(demo_app):
    stats = wait_idle(demo_app, timeout=30.0)
    return {r["replica_id"] for r in stats["replicas"]}


@pytest.mark.parametrize("path, raw", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_attack_input_is_never_a_5xx(before, server, client, path, raw):
    response = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code < 500, f"{response.status_code}: {response.text[:300]}"
    if response.status_code != 200:
        assert 400 <= response.status_code < 500 and response.json()["error"]["message"]


def test_a_huge_header_is_431(client):
    response = client.post(C, json=comp(), headers={"x-huge": "h" * (1 << 20)})
    assert response.status_code == 431, response.status_code


def test_a_thousand_idle_streams_hold_nothing_once_closed(before, server, client):
    """1,000 connections each send a streamed request and never read a byte: each is admitted (200) or refused
    (429) like any request, the server keeps answering others meanwhile, and closing them gives everything back."""
    body = json.dumps(comp(max_tokens=4, ignore_eos=True, stream=True)).encode()
    head = (f"POST {C} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    sockets = []
    try:
        for _ in range(1000):
            sock = socket.create_connection((HOST, HTTP_PORT), timeout=10.0)
            sock.sendall(head + body)
            sockets.append(sock)
        assert client.get("/health").status_code == 200
        response = client.post(C, json=comp(max_tokens=2, ignore_eos=True))
        assert response.status_code in (200, 429), response.text[:300]
        deadline = time.monotonic() + 120.0
        statuses = []
        for sock in sockets:  # every one was answered: its status line is waiting, unread, in its socket
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            statuses.append(sock.recv(64).split(b" ", 2)[1])
        assert set(statuses) <= {b"200", b"429"}, set(statuses)
        assert b"200" in statuses
    finally:
        for sock in sockets:
            sock.close()


def test_the_server_is_whole_afterwards(before, server, client):
    assert client.get("/health").status_code == 200
    response = client.post(C, json=comp(max_tokens=4, ignore_eos=True))
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    stats = wait_idle(server, timeout=30.0)
    assert {r["replica_id"] for r in stats["replicas"]} == before, "a replica restarted"
    for replica in stats["replicas"]:
        assert replica["kv_blocks_used"] == 0
    assert get_stats(server)["router"]["in_flight"] == 0
