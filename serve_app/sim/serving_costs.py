"""The serving path's own costs, measured on a running server against a profile's engine step costs.

* Per request: one-token completions of a short prompt, one after another; what each takes beyond the engine's
  predicted prompt step is the fixed cost of HTTP, tokenizing and the router's hop (``ServingCosts.request_s``).
* Per streamed token: 1 and then 8 streams per replica at once (the server's /stats says how many replicas it has;
  the router spreads the streams); the gap between two of a stream's tokens beyond the engine's predicted decode
  step, per stream in the step, is what each message adds to a step (``message_s``: the replica's work per
  message, on the cores the engine uses).
* Under load: a burst of 8 requests per replica (prompts of 64 to 512 tokens, 32 tokens each) is timed through the
  server and simulated on the profile with the two costs above; ``step_factor`` scales every simulated step until
  the simulated burst takes as long as the measured one. It is what replicas loaded together do to each other's
  steps: on this 2-core machine two served replicas, the router and the proxy share the cores, and a served
  prompt step under load ran ~20% slower than the engine's alone, which probes of an idle server never see (a
  factor fitted from the probes above came out 0.76-0.98); on a machine per replica (GPUs) it should be ~1.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from inflight.serve_app.sim.trace import TraceRequest, synthetic_tokens

if TYPE_CHECKING:
    from inflight.serve_app.sim.profile import Profile


@dataclass(frozen=True)
class ServingCosts:
    """The serving path's costs around the engine: the latency before a request reaches it, and the time a step
    takes longer for each token it streams out."""

    request_s: float = 0.0
    message_s: float = 0.0
    step_factor: float = 1.0  # every step of a loaded server against the engine alone (calibrated on a burst)


PROMPT_TOKENS = 32
BURST_PER_REPLICA, BURST_TOKENS = 8, 32
STREAM_TOKENS = 48
STREAMS_PER_REPLICA = (1, 8)
SINGLE_REQUESTS = 12


def measure_serving(url: str, profile: "Profile") -> ServingCosts:
    """The server at ``url``'s costs around ``profile``'s engine (which it must serve, with the same flags)."""
    import httpx

    costs, vocab_size = profile.cost_model, profile.engine["vocab_size"]
    base = url.rstrip("/")
    with httpx.Client(timeout=120.0) as client:
        try:
            models = client.get(f"{base}/v1/models").raise_for_status().json()["data"]
        except (httpx.HTTPError, KeyError, ValueError) as e:
            raise ValueError(f"--serving-url {url}: no OpenAI models list there ({e})") from None
        model = models[0]["id"]
        try:
            replicas = max(1, len(client.get(f"{base}/stats").raise_for_status().json()["replicas"]))
        except (httpx.HTTPError, KeyError, ValueError, TypeError):
            replicas = 1

        def body(index: int, max_tokens: int, stream: bool, prompt_tokens: int = PROMPT_TOKENS) -> dict:
            return {"model": model, "prompt": synthetic_tokens(f"serving:{index}", prompt_tokens, vocab_size),
                    "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": stream}

        client.post(f"{base}/v1/completions", json=body(-1, 4, False)).raise_for_status()  # warm-up
        latencies = []
        for i in range(SINGLE_REQUESTS):
            started = time.perf_counter()
            client.post(f"{base}/v1/completions", json=body(i, 1, False)).raise_for_status()
            latencies.append(time.perf_counter() - started)
    request_s = max(0.0, statistics.median(latencies) - costs.step_seconds([PROMPT_TOKENS], [0], [True]))
    excess = []  # per load: (streams in a replica's step, the median gap beyond the engine's predicted step)
    for streams in STREAMS_PER_REPLICA:
        bodies = [body(1000 * streams + i, STREAM_TOKENS, True) for i in range(streams * replicas)]
        context = PROMPT_TOKENS + STREAM_TOKENS // 2
        predicted = costs.step_seconds([1] * streams, [context] * streams, [True] * streams, rebuilt=False)
        excess.append((streams, statistics.median(_gaps(_streams(base, bodies)[1])) - predicted))
    message_s = per_message_cost(excess)
    burst = burst_trace(BURST_PER_REPLICA * replicas)
    started, times = _streams(base, [body(5000 + i, r.max_tokens, True, r.prompt_tokens) for i, r in enumerate(burst)])
    measured = max(t[-1] for t in times) - started
    return ServingCosts(request_s, message_s, calibrate_step_factor(profile, burst, replicas, measured, request_s,
                                                                   message_s))


def burst_trace(num: int) -> list[TraceRequest]:
    """``num`` requests at once, prompts spread from 64 to 512 tokens, ``BURST_TOKENS`` each."""
    return [TraceRequest(int(64 * 8 ** (i / max(1, num - 1))), BURST_TOKENS) for i in range(num)]


def calibrate_step_factor(profile: "Profile", burst: list[TraceRequest], replicas: int, measured_s: float,
                          request_s: float, message_s: float) -> float:
    """The factor on every step that makes the simulated burst take ``measured_s`` (a few fixed-point rounds: the
    burst's time is nearly proportional to it)."""
    from inflight.serve_app.sim.cli import fleet_setup
    from inflight.serve_app.sim.fleet import simulate

    factor = 1.0
    for _ in range(4):
        serving = ServingCosts(request_s, message_s, factor)
        result = simulate(burst, fleet_setup(dataclasses.replace(profile, serving=serving), {}), replicas)
        factor *= measured_s / (result.end - result.start)
    return min(max(factor, 0.2), 5.0)


def per_message_cost(excess: list[tuple[int, float]]) -> float:
    """The least-squares cost per message of (streams, seconds beyond the predicted step) pairs, not below 0."""
    return max(0.0, sum(n * e for n, e in excess) / sum(n * n for n, _ in excess))


def _gaps(times: list[list[float]]) -> list[float]:
    """The gaps between consecutive tokens of each stream (the first two tokens' gap left out: the other streams'
    prompts may still be computing)."""
    gaps = [b - a for stream in times for a, b in zip(stream[2:], stream[3:])]
    if not gaps:
        raise ValueError("--serving-url: the streams brought too few tokens to time")
    return gaps


def _streams(base: str, bodies: list[dict]) -> tuple[float, list[list[float]]]:
    """The streams run at once: when they were started, and each one's token arrival times (``perf_counter``)."""
    import httpx

    streams: list[list[float]] = [[] for _ in bodies]
    errors: list[BaseException] = []

    def one(times: list[float], body: dict) -> None:
        try:
            with httpx.Client(timeout=300.0) as client, client.stream("POST", f"{base}/v1/completions",
                                                                       json=body) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        if json.loads(line[6:]).get("choices"):
                            times.append(time.perf_counter())
        except BaseException as e:  # reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=one, args=(times, body)) for times, body in zip(streams, bodies)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise ValueError(f"--serving-url: a streamed request failed ({errors[0]})")
    if not all(streams):
        raise ValueError("--serving-url: a stream brought no token")
    return started, streams
