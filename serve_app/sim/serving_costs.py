"""The serving path's own costs, measured on a running server against a profile's engine step costs.

* Per request: single completions of one token, one after another, of a short and a long prompt: what each takes
  beyond the engine's predicted prompt step is the fixed cost of HTTP, tokenizing and the router's hop
  (``ServingCosts.request_s``) and how much slower a prompt computes in the server (``prompt_factor``: on this
  2-core machine the served engine's prompt steps ran ~20% slower than the engine's alone).
* Per step: 1, 4 and 8 streams per replica at once (the server's /stats says how many replicas it has; the router
  spreads the streams, so every replica is busy). The gap between two of a stream's tokens against the engine's
  predicted decode step is fitted to ``step_factor`` x the step + ``message_s`` x the streams in it: how much
  slower a step runs in the server (its engine shares the cores with the other replicas' engines, the router,
  the proxy and the replicas' front ends: on this 2-core machine that is most of it; on a GPU, ~1) and what each
  streamed message adds (the replica's work per message).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import dataclass

import numpy as np

from inflight.serve_app.sim.cost_model import StepCostModel, step_features
from inflight.serve_app.sim.trace import synthetic_tokens

@dataclass(frozen=True)
class ServingCosts:
    """The serving path's costs around the engine: the latency before a request reaches it, how much slower a step
    runs in the server than the engine alone (``step_factor``: the cores it shares), and the time a step takes
    longer for each token it streams out."""

    request_s: float = 0.0
    message_s: float = 0.0
    step_factor: float = 1.0
    prompt_factor: float = 1.0  # a prompt's compute in the server against the engine alone (StepCostModel.split)


PROMPT_TOKENS = 32
LONG_PROMPT_TOKENS = 512
STREAM_TOKENS = 48
STREAMS_PER_REPLICA = (1, 4, 8)
SINGLE_REQUESTS = 12


def measure_serving(url: str, costs: StepCostModel, vocab_size: int | None = None) -> ServingCosts:
    import httpx

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
        latency = {}  # prompt length -> the median time of a one-token completion, the fleet otherwise idle
        for length in (PROMPT_TOKENS, LONG_PROMPT_TOKENS):
            times = []
            for i in range(SINGLE_REQUESTS // 2):
                started = time.perf_counter()
                client.post(f"{base}/v1/completions", json=body(100 * length + i, 1, False, length)).raise_for_status()
                times.append(time.perf_counter() - started)
            latency[length] = statistics.median(times)
    # latency = request_s + prompt_factor x the prompt's predicted compute + the rest of its step
    (short_prompt, short_rest), (long_prompt, long_rest) = (
        costs.split(step_features([n], [0], [True])) for n in (PROMPT_TOKENS, LONG_PROMPT_TOKENS))
    prompt_factor = max(0.0, (latency[LONG_PROMPT_TOKENS] - latency[PROMPT_TOKENS] - (long_rest - short_rest))
                        / (long_prompt - short_prompt))
    request_s = max(0.0, latency[PROMPT_TOKENS] - prompt_factor * short_prompt - short_rest)
    predicted, gaps = [], []  # per load: the engine's predicted decode step, and the median gap the streams saw
    for streams in STREAMS_PER_REPLICA:
        bodies = [body(1000 * streams + i, STREAM_TOKENS, True) for i in range(streams * replicas)]
        gaps.append(statistics.median(_stream_gaps(base, bodies)))
        context = PROMPT_TOKENS + STREAM_TOKENS // 2
        predicted.append(costs.step_seconds([1] * streams, [context] * streams, [True] * streams, rebuilt=False))
    step_factor, message_s = fit_step_costs(predicted, list(STREAMS_PER_REPLICA), gaps)
    return ServingCosts(request_s, message_s, step_factor, prompt_factor)


def fit_step_costs(predicted: list[float], streams: list[int], gaps: list[float]) -> tuple[float, float]:
    """(step_factor, message_s) with gap = step_factor x predicted + message_s x streams, least squares, neither
    negative (a term that would be is dropped and the other refitted)."""
    x = np.array([predicted, streams], dtype=np.float64).T
    y = np.array(gaps, dtype=np.float64)
    (factor, per_message), *_ = np.linalg.lstsq(x, y, rcond=None)
    if per_message < 0:
        return float(x[:, 0] @ y / (x[:, 0] @ x[:, 0])), 0.0
    if factor < 0:
        return 0.0, float(x[:, 1] @ y / (x[:, 1] @ x[:, 1]))
    return float(factor), float(per_message)


def _stream_gaps(base: str, bodies: list[dict]) -> list[float]:
    """The gaps between consecutive tokens of each stream, the streams run at once (the first two tokens' gap left
    out: the others' prompts may still be computing)."""
    import httpx

    gaps: list[float] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def one(body: dict) -> None:
        try:
            times = []
            with httpx.Client(timeout=300.0) as client, client.stream("POST", f"{base}/v1/completions",
                                                                       json=body) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        if json.loads(line[6:]).get("choices"):
                            times.append(time.perf_counter())
            with lock:
                gaps.extend(b - a for a, b in zip(times[2:], times[3:]))
        except BaseException as e:  # reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=one, args=(b,)) for b in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise ValueError(f"--serving-url: a streamed request failed ({errors[0]})")
    if not gaps:
        raise ValueError("--serving-url: the streams brought too few tokens to time")
    return gaps
