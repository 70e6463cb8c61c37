"""benchmarks.serving.serving against a real HTTP server on this machine (aiohttp's): streaming timings, failures by
status, concurrency cap, a refused connection."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from aiohttp import web

from benchmarks.common.metrics import SLO
from benchmarks.serving import serving
from benchmarks.serving.serving import LoadRequest, RequestResult, run_load, summarize_load


def sse(*events) -> bytes:
    return b"".join(f"data: {json.dumps(e) if isinstance(e, dict) else e}\n\n".encode() for e in events)


class FakeServer:
    """Streams ``max_tokens`` one-token chunks, each its own write; prompts starting with 429 / 500 / 999 get that
    status / an error event. Records the most requests it had in flight at once. ``hold_until_in_flight``: a
    request is held until that many have been in flight at once (at most 10 s), so that a client that may send
    them together is seen to, however late the one after it comes on a busy machine."""

    def __init__(self, hold_until_in_flight: int = 0) -> None:
        self.in_flight = 0
        self.max_in_flight = 0
        self.hold_until_in_flight = hold_until_in_flight
        self._enough_in_flight = asyncio.Event()
        self.connections: set[tuple] = set()  # the clients' (host, port): one per connection
        self.bodies: list[dict] = []

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.connections.add(request.transport.get_extra_info("peername"))
        body = await request.json()
        self.bodies.append(body)
        first = body["prompt"][0]
        if first in (429, 500):
            return web.json_response({"error": {"message": "no"}}, status=first)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        if self.max_in_flight >= self.hold_until_in_flight:
            self._enough_in_flight.set()
        await asyncio.wait_for(self._enough_in_flight.wait(), 10.0)
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if first == 999:
            await response.write(sse({"error": {"message": "engine died"}}, "[DONE]"))
            return response
        for _ in range(body["max_tokens"]):
            await response.write(sse({"choices": [{"text": "x"}]}))
        await response.write(sse({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}, "[DONE]"))
        return response


async def _served(server: FakeServer, requests, arrivals, max_concurrency, extra=None):
    app = web.Application()
    app.router.add_post("/v1/completions", server.completions)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    try:
        return await run_load(f"http://127.0.0.1:{port}", "m", requests, arrivals, max_concurrency, extra or {}, 10.0,
                              "test")
    finally:
        await runner.cleanup()


def run(requests, arrivals, max_concurrency=None, server=None, extra=None):
    return asyncio.run(_served(server or FakeServer(), requests, arrivals, max_concurrency, extra))


def test_failures_are_counted_by_status_with_429_apart():
    requests = [LoadRequest([7, 8], 3), LoadRequest([429], 3), LoadRequest([429], 3), LoadRequest([500], 3),
                LoadRequest([999], 3)]
    results, duration = run(requests, [0.0] * 5)
    summary = summarize_load(results, duration, SLO())
    assert summary["num_ok"] == 1 and summary["num_429"] == 2
    assert summary["failures"] == {"429": 2, "500": 1, "error in stream": 1}
    ok = results[0]
    assert ok.num_tokens == 3 and len(ok.chunk_times_s) == 3 and 0 < ok.ttft_s <= ok.e2e_s
    assert summary["goodput_requests_per_s"] == pytest.approx(1 / duration)


def test_requests_that_stop_at_end_of_sequence_never_ask_to_ignore_it():
    """--ignore-eos (the default) asks for exactly max_tokens of token-id prompts; the chat workload's requests
    stop at the model's end of turn whatever it says."""
    server = FakeServer()
    results, _ = run([LoadRequest([7, 8], 2), LoadRequest([9], 3, ignore_eos=False)], [0.0, 0.0], server=server,
                     extra={"temperature": 0.0, "ignore_eos": True})
    assert all(r.ok for r in results)
    bodies = {tuple(b["prompt"]): b for b in server.bodies}
    assert bodies[(7, 8)]["ignore_eos"] is True and "ignore_eos" not in bodies[(9,)]
    assert bodies[(9,)]["temperature"] == 0.0 and bodies[(9,)]["max_tokens"] == 3


def test_max_concurrency_caps_requests_in_flight():
    server = FakeServer(hold_until_in_flight=2)
    results, _ = run([LoadRequest([7], 2)] * 6, [0.0] * 6, max_concurrency=2, server=server)
    assert all(r.ok for r in results) and server.max_in_flight == 2


def test_requests_one_after_another_keep_one_connection():
    """The client reads each stream to its end, so the next request reuses the connection, as a real client's
    would: a new connection per request costs both ends CPU the benchmark would charge to the server."""
    server = FakeServer()
    results, _ = run([LoadRequest([7], 3)] * 4, [0.0] * 4, max_concurrency=1, server=server)
    assert all(r.ok for r in results) and len(server.connections) == 1


def test_a_refused_connection_is_a_failure_without_status():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results, _ = asyncio.run(run_load(f"http://127.0.0.1:{port}", "m", [LoadRequest([7], 2)], [0.0], None, {}, 10.0,
                                      "test"))
    assert results[0].failure == "no response" and results[0].status is None


def test_tpot_needs_two_tokens():
    assert RequestResult(200, ttft_s=0.1, e2e_s=0.5, num_tokens=5).tpot_s == pytest.approx(0.1)
    assert RequestResult(200, ttft_s=0.1, e2e_s=0.1, num_tokens=1).tpot_s is None


def test_bad_flags_are_named(capsys):
    for argv, flag in ((["--rates", "0"], "--rates"), (["--vocab-range", "5", "5"], "--vocab-range"),
                       (["--slo-ttft-ms", "-1"], "--slo-ttft-ms"), (["--output-lens", "9", "3"], "--output-lens")):
        with pytest.raises(SystemExit):
            serving.parse_args(argv)
        assert flag in capsys.readouterr().err
