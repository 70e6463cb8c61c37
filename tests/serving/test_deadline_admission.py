"""A deadline the engine predicts it cannot meet gets 429 with Retry-After at once, not a late 504."""

from __future__ import annotations

import asyncio
import re
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


async def _until_waiting(client: httpx.AsyncClient, base: str, num_waiting: int, timeout_s: float = 30.0) -> None:
    """Until the replica's engine has ``num_waiting`` requests waiting, however long they took to get there."""
    deadline = time.monotonic() + timeout_s
    while True:
        replica = (await client.get(base + "/stats")).json()["replicas"][0]
        if replica["num_waiting"] >= num_waiting:
            return
        assert time.monotonic() < deadline, f"never {num_waiting} requests waiting: {replica}"
        await asyncio.sleep(0.05)


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
            # The long prompts queued in the engine (it runs two at a time): half of them at least, ~20,000 tokens
            # of prefill ahead of the next request.
            await _until_waiting(client, server, 12)
            hurried = await client.post(server + "/v1/completions",
                                        json={"model": MODEL, "prompt": "quick?", "max_tokens": 4, "timeout": 0.3})
            patient = await client.post(server + "/v1/completions",
                                        json={"model": MODEL, "prompt": "I can wait", "max_tokens": 4,
                                              "timeout": 60})
            return hurried, patient, await asyncio.gather(*queued)

    hurried, patient, queued_statuses = asyncio.run(run())
    assert hurried.status_code == 429, hurried.text
    assert int(hurried.headers["Retry-After"]) >= 1
    body = hurried.json()
    assert_schema("ErrorResponse", body)
    assert "deadline" in body["error"]["message"]
    # Refused at admission, before the deadline passed, by the server's clock (the deadline runs from the router's
    # taking the request; how long the answer then takes to reach this client on a busy machine is not the point).
    left = re.search(r"the deadline \((-?[0-9.]+) s from now\)", body["error"]["message"])
    assert left and float(left.group(1)) > 0, "refused at admission, before the deadline passed"
    assert patient.status_code == 200
    assert queued_statuses == [200] * 24  # the refusal disturbed nobody
    wait_idle(server, timeout=20.0)
