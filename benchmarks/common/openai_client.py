"""A streaming OpenAI-API client for benchmarks: per-request TTFT, inter-token gaps and end-to-end time; and
``SSEReader``, how every benchmark reads a server-sent-event stream (this client's, and the soak's on httpx).

Works against any OpenAI-compatible endpoint (ours, vLLM, ...). Uses aiohttp, as vLLM's own benchmark client does:
its HTTP parser is C, so on a small machine that also runs the server the load generator takes little of the CPU
the server needs. (httpx's pure-Python stack cost ~2.8 ms of CPU per streamed request at 64 streams on the 2-core
demo, aiohttp's ~0.7 ms: docs/benchmarks-history.md.)
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterable, AsyncIterator

import aiohttp

# What a request that got no answer raises: refused or reset connections, timeouts, broken responses.
CLIENT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


@dataclass
class SSEReader:
    """One OpenAI-style event stream read from its lines (bytes or str, as the HTTP client yields them): each
    ``data:`` line's JSON object in order, up to ``data: [DONE]``. Afterwards ``done`` says whether ``[DONE]``
    came, ``num_malformed`` how many data lines were not JSON (skipped)."""

    done: bool = False
    num_malformed: int = 0

    async def events(self, lines: AsyncIterable[bytes | str]) -> AsyncIterator[dict[str, Any]]:
        async for line in lines:
            if line[:6] not in (b"data: ", "data: "):
                continue
            data = line[6:].strip()
            if data in (b"[DONE]", "[DONE]"):
                self.done = True
                return
            try:
                event = json.loads(data)
            except ValueError:
                self.num_malformed += 1
                continue
            yield event


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


def client_session(max_connections: int, timeout_s: float) -> aiohttp.ClientSession:
    """A session that keeps up to ``max_connections`` connections open between requests (a line of up to
    ``read_bufsize`` bytes: an event with many logprobs is long)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max_connections),
                                 timeout=aiohttp.ClientTimeout(total=timeout_s), read_bufsize=4 << 20)


async def stream_completion(session: aiohttp.ClientSession, base_url: str, model: str, prompt: str | list[int],
                            max_tokens: int, **extra) -> StreamResult:
    """POST /v1/completions with stream=True and include_usage; time the first content and every chunk. The body is
    read to its end, so the connection is kept for the next request (as a real client's would be)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    start = time.perf_counter()
    async with session.post(f"{base_url}/v1/completions", json=body) as response:
        if response.status != 200:
            return StreamResult(response.status, error=(await response.text())[:200])
        result = StreamResult(200)
        sse = SSEReader()
        async for event in sse.events(response.content):  # one line at a time, whatever chunks it came in
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
        await response.read()  # the body to its end (nothing after [DONE]), so the connection is kept
        result.e2e_s = time.perf_counter() - start
        if sse.num_malformed:
            result.error = f"{sse.num_malformed} events that are not JSON"
        return result
