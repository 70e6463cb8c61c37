"""The router's gate against a real server: API keys on every route but GET /health, whatever the path's
spelling or the method; bounded headers and bodies (431, 413) before any route reads them; bounded stop lists
and messages. A keyed app is deployed beside the open demo app, with two tenants' keys in a file."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.serving.apps import DEMO_APP_ARGS, delete_app, deploy_app
from tests.serving.helpers import BASE_URL, MODEL, assert_error_body, wait_idle

pytestmark = pytest.mark.timeout(180, func_only=True)

KEYS = {"tenant-a": "key-a-0123456789", "tenant-b": "key-b-9876543210", "tenant-c": "key-c-limited-000",
        "tenant-d": "key-d-embedder-00"}
# tenant-c is held to one request at a time and 1,200 tokens a minute (20 a second)
LIMITS = {"tenant-c": {"max_concurrent_requests": 1, "tokens_per_minute": 1200}, "tenant-d": {"tokens_per_minute": 60}}
PREFIX = "/secure"
BODY_TIMEOUT_S = 3.0
COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}


@pytest.fixture(scope="module")
def secure_app(ray_cluster, tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("keys") / "api-keys"
    keys_file.write_text("# tenant key\n" + "".join(f"{t} {k}\n" for t, k in KEYS.items()))
    args = {**DEMO_APP_ARGS, "num_cpus_per_replica": 0.5, "api_keys_file": str(keys_file), "tenant_limits": LIMITS,
            "body_timeout_s": BODY_TIMEOUT_S}
    yield deploy_app(args, name="secure", route_prefix=PREFIX, headers=bearer(KEYS["tenant-a"]))
    delete_app("secure")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_unauthorized(response: httpx.Response) -> None:
    error = assert_error_body(response, 401, "invalid_request_error")
    assert error["code"] == "invalid_api_key", error
    assert all(k not in response.text for k in KEYS.values())


# raw paths after the app's prefix: every spelling of a route, other methods, and near-misses of /health
TRICKS = [("POST", "/v1/completions"), ("POST", "//v1/completions"), ("POST", "/v1/./completions"),
          ("POST", "/v1/%63ompletions"), ("POST", "/v1/completions/"), ("GET", "/v1/completions"),
          ("PUT", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/stats"),
          ("POST", "/tokenize"), ("POST", "/v1/embeddings"), ("GET", "/docs"), ("GET", "/openapi.json"),
          ("GET", "/health/"), ("POST", "/health"), ("GET", "/HEALTH"), ("GET", "/nothing-here")]


@pytest.mark.parametrize("method, path", TRICKS, ids=[f"{m} {p}" for m, p in TRICKS])
def test_every_route_but_health_needs_a_key(secure_app, method, path):
    with httpx.Client(timeout=30.0) as client:
        for headers in ({}, bearer("wrong-key-0000"), {"Authorization": f"Basic {KEYS['tenant-a']}"},
                        {"Authorization": KEYS["tenant-a"]}):
            request = client.build_request(method, BASE_URL + PREFIX + path, headers=headers, json=COMPLETION)
            request.url = request.url.copy_with(raw_path=(PREFIX + path).encode())  # sent as written, not normalised
            assert_unauthorized(client.send(request))


def test_health_is_open_and_both_tenants_keys_work(secure_app):
    assert httpx.get(secure_app + "/health", timeout=10.0).status_code == 200
    for key in KEYS.values():
        response = httpx.post(secure_app + "/v1/completions", json=COMPLETION, headers=bearer(key), timeout=60.0)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3
    models = httpx.get(secure_app + "/v1/models", headers={"authorization": f"bearer {KEYS['tenant-b']}"},
                       timeout=10.0)
    assert models.status_code == 200  # the scheme and the header's name in any case


def test_a_body_without_a_key_is_refused_before_it_is_read(secure_app):
    response = httpx.post(secure_app + "/v1/completions", content=b"x" * (5 << 20), timeout=60.0)
    assert_unauthorized(response)


def test_oversized_bodies_are_413_and_headers_431(server, client):
    big = json.dumps({**COMPLETION, "prompt": "a" * (5 << 20)}).encode()
    error = assert_error_body(client.post("/v1/completions", content=big,
                                          headers={"content-type": "application/json"}), 413)
    assert "larger than" in error["message"]

    def chunks():  # no Content-Length: the bound is counted as the body arrives
        yield b'{"model": "demo-tiny", "prompt": "'
        for _ in range(6):
            yield b"a" * (1 << 20)
        yield b'"}'

    assert_error_body(client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}),
                      413)
    assert_error_body(client.post("/v1/completions", json=COMPLETION, headers={"x-padding": "p" * (40 << 10)}), 431)
    assert client.get("/health").status_code == 200
    assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    wait_idle(server, timeout=10.0)


@pytest.mark.parametrize("body, param", [
    ({**COMPLETION, "stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({**COMPLETION, "stop": ["x" * 1001]}, "stop"),
    ({**COMPLETION, "stop_token_ids": list(range(7, 72))}, "stop_token_ids"),
    ({**COMPLETION, "timeout": 1e308 * 10}, "timeout"),
    ({**COMPLETION, "priority": 2 ** 40}, "priority"),
], ids=["17-stop-strings", "long-stop-string", "65-stop-token-ids", "infinite-timeout", "huge-priority"])
def test_unbounded_parameters_are_400(client, body, param):
    raw = json.dumps(body).encode()  # Infinity is sent as Python's json writes it
    error = assert_error_body(client.post("/v1/completions", content=raw, headers={"content-type": "application/json"}),
                              400, "invalid_request_error")
    assert param in (error["param"] or ""), error


def test_too_many_messages_or_content_parts_are_400(client):
    many = [{"role": "user", "content": "hi"}] * 2049
    assert_error_body(client.post("/v1/chat/completions", json={"model": MODEL, "messages": many}), 400)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}] * 257}]
    assert_error_body(client.post("/v1/chat/completions", json={"model": MODEL, "messages": parts}), 400)


def test_tenants_never_share_cached_prompt_blocks(secure_app):
    """The same prompt from one tenant hits its cache; from the other it does not (it could otherwise time
    whether someone sent it); the router salts by the key's tenant, not by anything the client sends."""
    prompt = "A shared system prompt that is long enough to fill several KV blocks of sixteen tokens. " * 3

    def counters(key):  # (hit tokens, looked-up tokens) as the replicas last reported them
        stats = httpx.get(secure_app + "/stats", headers=bearer(key), timeout=10.0).json()
        return tuple(sum(r[name] for r in stats["replicas"])
                     for name in ("prefix_cache_hit_tokens", "prefix_cache_query_tokens"))

    def sent(key, before):
        """Send the prompt; the counters once the replicas have reported it (a report from before it may still be
        the router's latest when the answer comes)."""
        body = {**COMPLETION, "prompt": prompt}
        response = httpx.post(secure_app + "/v1/completions", json=body, headers=bearer(key), timeout=60.0)
        assert response.status_code == 200, response.text
        deadline = time.monotonic() + 10
        while (now := counters(key))[1] <= before[1]:
            assert time.monotonic() < deadline, "the replicas never reported the request"
            time.sleep(0.1)
        return now

    a, b = KEYS["tenant-a"], KEYS["tenant-b"]
    start = sent(a, counters(a))
    after_b = sent(b, start)
    assert after_b[0] == start[0], "tenant b must not hit tenant a's blocks"
    after_a = sent(a, after_b)
    assert after_a[0] >= start[0] + 64, "tenant a hits its own blocks"
    assert sent(b, after_a)[0] >= start[0] + 128, "and tenant b its own"


def test_a_tenants_limits_give_429_with_a_retry_after_that_works(secure_app):
    """tenant-c: a second request while one streams is refused; a request beyond its token budget is refused
    with the seconds the budget needs to refill, and the retry after them succeeds; tenant-a is not affected."""
    c = bearer(KEYS["tenant-c"])
    with httpx.Client(base_url=secure_app, timeout=60.0) as client:
        body = {**COMPLETION, "max_tokens": 200, "stream": True}
        with client.stream("POST", "/v1/completions", json=body, headers=c) as streaming:
            assert streaming.status_code == 200
            busy = client.post("/v1/completions", json=COMPLETION, headers=c)
            assert_error_body(busy, 429)
            assert "in flight" in busy.json()["error"]["message"]
            assert client.post("/v1/completions", json=COMPLETION, headers=bearer(KEYS["tenant-a"])).status_code == 200
            for _ in streaming.iter_lines():
                pass
        # the stream used ~200 tokens of 1,200; a request reserving ~1,150 must wait for the refill (20 a second)
        big = {**COMPLETION, "max_tokens": 1150}
        refused = client.post("/v1/completions", json=big, headers=c)
        error = assert_error_body(refused, 429)
        assert "per minute" in error["message"]
        retry_after = float(refused.headers["retry-after"])
        assert 0 < retry_after <= 60
        time.sleep(retry_after + 0.5)
        assert client.post("/v1/completions", json=big, headers=c).status_code == 200


def test_a_trickled_body_is_cut_off_without_holding_a_slot(secure_app):
    """tenant-c may have one request in flight: a client that sends its headers and a tenth of its body, then
    nothing, gets 408 once the body's time is up, and meanwhile tenant-c's other requests go through."""
    body = json.dumps(COMPLETION).encode()
    head = (f"POST {PREFIX}/v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEYS['tenant-c']}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", 8000), timeout=BODY_TIMEOUT_S + 30.0) as slow:
        started = time.monotonic()
        slow.sendall(head + body[:len(body) // 10])
        ok = httpx.post(secure_app + "/v1/completions", json=COMPLETION, headers=bearer(KEYS["tenant-c"]), timeout=30.0)
        assert ok.status_code == 200, ok.text
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = slow.recv(4096)
            if not chunk:
                break
            answer += chunk
    waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"request_timeout" in answer
    assert BODY_TIMEOUT_S - 0.5 <= waited <= BODY_TIMEOUT_S + 20.0, waited


def test_embeddings_count_against_a_tenants_token_budget(secure_app):
    """tenant-d has 60 tokens a minute: one embedding of a long input spends more than that (settled from its
    usage), so the next is refused with a Retry-After, and other tenants' embeddings are not."""
    body = {"model": MODEL, "input": "the quick brown fox jumps " * 20}
    first = httpx.post(secure_app + "/v1/embeddings", json=body, headers=bearer(KEYS["tenant-d"]), timeout=60.0)
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["prompt_tokens"] > 60
    error = assert_error_body(httpx.post(secure_app + "/v1/embeddings", json=body, headers=bearer(KEYS["tenant-d"]),
                                         timeout=60.0), 429)
    assert "per minute" in error["message"]
    other = httpx.post(secure_app + "/v1/embeddings", json=body, headers=bearer(KEYS["tenant-a"]), timeout=60.0)
    assert other.status_code == 200, other.text
