"""Many requests at once: 32 concurrent streams all complete; 400 at once get 200 or 429 (never 5xx)."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest

from tests.serving.helpers import (
    MODEL,
    assert_schema,
    completion_body,
    gather_bounded,
    get_stats,
    parse_sse,
    post_stream,
    wait_idle,
)


async def _stream(client: httpx.AsyncClient, base: str, i: int, max_tokens: int):
    body = {"model": MODEL, "prompt": f"Concurrent stream number {i}:", "max_tokens": max_tokens, "ignore_eos": True,
            "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", base + "/v1/completions", json=body) as response:
        raw = (await response.aread()).decode()
    return response.status_code, raw


@pytest.mark.slow
@pytest.mark.timeout(90, func_only=True)
def test_32_concurrent_streams_complete(server):
    max_tokens = 64

    async def run():
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=60.0, limits=limits) as client:
            return await gather_bounded([_stream(client, server, i, max_tokens) for i in range(32)], timeout=75)

    results = asyncio.run(run())
    assert [status for status, _ in results] == [200] * 32, [r[1][:200] for r in results if r[0] != 200]
    for i, (_, raw) in enumerate(results):
        stream = parse_sse(raw)
        assert stream.done and not stream.errors, (i, stream.errors)
        tokens = [t for c in stream.chunks for ch in c["choices"] for t in ch["logprobs"]["tokens"]]
        assert len(tokens) == max_tokens, (i, len(tokens))
        assert stream.usage["completion_tokens"] == max_tokens, (i, stream.usage)
        assert stream.chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert len({parse_sse(raw).chunks[0]["id"] for _, raw in results}) == 32, "every stream has its own id"
    wait_idle(server, timeout=10.0)


@pytest.mark.slow
@pytest.mark.timeout(120, func_only=True)
def test_overload_gets_429_with_retry_after_and_no_5xx(server):
    num_requests = 400
    before = get_stats(server)["router"]["num_rejected"]

    async def one(client: httpx.AsyncClient, i: int):
        body = {"model": MODEL, "prompt": f"overload {i}", "max_tokens": 32, "ignore_eos": True}
        if i % 4 == 0:
            body["stream"] = True
            async with client.stream("POST", server + "/v1/completions", json=body) as response:
                return response, (await response.aread()).decode()
        response = await client.post(server + "/v1/completions", json=body)
        return response, response.text

    async def run():
        limits = httpx.Limits(max_connections=num_requests, max_keepalive_connections=num_requests)
        async with httpx.AsyncClient(timeout=90.0, limits=limits) as client:
            return await gather_bounded([one(client, i) for i in range(num_requests)], timeout=110)

    results = asyncio.run(run())
    statuses = Counter(r.status_code for r, _ in results)
    assert set(statuses) <= {200, 429}, f"only 200 and 429 are acceptable under overload: {statuses}"
    assert statuses[429] >= 1, f"{num_requests} concurrent requests against max_pending_requests=48: no 429? {statuses}"
    assert statuses[200] >= 1, statuses
    for response, text in results:
        if response.status_code == 429:
            retry_after = response.headers.get("retry-after")
            assert retry_after is not None and retry_after.isdigit() and int(retry_after) >= 1, response.headers
            body = response.json()
            assert_schema("ErrorResponse", body)
            assert body["error"]["type"] == "rate_limit_exceeded", body
        elif text.startswith("data: "):
            stream = parse_sse(text)
            assert stream.done and not stream.errors, stream.errors
            assert sum(len(ch["text"]) > 0 for c in stream.chunks for ch in c["choices"]) >= 1
        else:
            assert response.json()["usage"]["completion_tokens"] == 32
    stats = wait_idle(server, timeout=15.0)
    assert stats["router"]["num_rejected"] - before >= statuses[429]
    # ...and then it serves normally.
    with httpx.Client(base_url=server, timeout=30) as client:
        response = client.post("/v1/completions", json=completion_body(max_tokens=8, ignore_eos=True))
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8
        _, stream = post_stream(client, "/v1/completions", completion_body(max_tokens=8))
        assert stream.done and not stream.errors
