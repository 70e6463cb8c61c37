"""A streaming OpenAI-API client for benchmarks: per-request TTFT, inter-token gaps and end-to-end time.

Works against any OpenAI-compatible endpoint (ours, vLLM, ...). Uses httpx's async client.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class StreamResult:
    status: int
    ttft_s: float | None = None
    e2e_s: float | None = None
    num_tokens: int = 0  # completion tokens (from usage when the server sends it)
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each content chunk, from the start
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


async def stream_completion(client: httpx.AsyncClient, base_url: str, model: str, prompt: str | list[int],
                            max_tokens: int, **extra) -> StreamResult:
    """POST /v1/completions with stream=True and include_usage; time the first content and every chunk."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    start = time.perf_counter()
    async with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return StreamResult(response.status_code, error=response.text[:200])
        result = StreamResult(200)
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                result.error = event["error"].get("message", "error")
                continue
            now = time.perf_counter() - start
            if event.get("usage"):
                result.num_tokens = event["usage"]["completion_tokens"]
            if event.get("choices") and event["choices"][0].get("text"):
                if result.ttft_s is None:
                    result.ttft_s = now
                result.chunk_times_s.append(now)
        result.e2e_s = time.perf_counter() - start
        return result
