"""A deadline the engine predicts it cannot meet gets 429 with Retry-After at once, not a late 504."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.serving.helpers import MODEL, assert_schema, wait_idle

LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 40  # ~1,800 byte tokens


async def _long_stream(client: httpx.AsyncClient, base: str, i: int) -> int:
    body = {"model": MODEL, "prompt": f"{i} {LONG_PROMPT}", "max_tokens": 16, "ignore_eos": True, "stream": True}
    async with client.stream("POST", base + "/v1/completions", json=body) as response:
        await response.aread()
    return response.status_code


@pytest.mark.timeout(120, func_only=True)
def test_unmeetable_deadline_gets_429_with_retry_after(server):
    with httpx.Client(timeout=60.0) as client:  # warm the engine's step-time model
        warm = client.post(server + "/v1/completions",
                           json={"model": MODEL, "prompt": "warm up", "max_tokens": 12, "ignore_eos": True})
        assert warm.status_code == 200

    async def run():
        limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
        async with httpx.AsyncClient(timeout=90.0, limits=limits) as client:
            queued = [asyncio.create_task(_long_stream(client, server, i)) for i in range(24)]
            await asyncio.sleep(0.5)  # the long prompts are queued in the engine now
            started = time.monotonic()
            hurried = await client.post(server + "/v1/completions",
                                        json={"model": MODEL, "prompt": "quick?", "max_tokens": 4, "timeout": 0.3})
            answered_in = time.monotonic() - started
            patient = await client.post(server + "/v1/completions",
                                        json={"model": MODEL, "prompt": "I can wait", "max_tokens": 4,
                                              "timeout": 60})
            return hurried, answered_in, patient, await asyncio.gather(*queued)

    hurried, answered_in, patient, queued_statuses = asyncio.run(run())
    assert hurried.status_code == 429, hurried.text
    assert int(hurried.headers["Retry-After"]) >= 1
    body = hurried.json()
    assert_schema("ErrorResponse", body)
    assert "deadline" in body["error"]["message"]
    assert answered_in < 0.3, "refused at admission, before the deadline passed"
    assert patient.status_code == 200
    assert queued_statuses == [200] * 24  # the refusal disturbed nobody
    wait_idle(server, timeout=20.0)
