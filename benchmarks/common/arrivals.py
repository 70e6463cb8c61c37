"""When requests arrive: a seeded Poisson or gamma process, or a JSONL trace file.

A trace line is ``{"prompt_tokens": 512, "output_tokens": 128, "arrival_s": 0.25}``: lengths in tokens,
arrival in seconds from the start (lines need not be sorted; ``arrival_s`` defaults to 0). It is
``inflight simulate``'s trace format (``serve_app/sim/trace.py``, which reads it: ``max_tokens`` is the same
field, and its optional fields are accepted too).
"""

from __future__ import annotations

import math

import numpy as np

from inflight.serve_app.sim.trace import TraceRequest, load_trace

__all__ = ["TraceEntry", "arrival_times", "load_trace"]


def arrival_times(num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Arrival offsets in seconds, the first at 0, with gamma-distributed gaps of mean 1/rate.

    ``burstiness`` is the gamma shape: 1 is a Poisson process; below 1 arrivals come in bursts (gaps vary
    more), above 1 they are more even. ``rate`` may be ``inf``: everything arrives at once.
    """
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    if burstiness == 1.0:  # the same draws as the Poisson traces recorded before gamma arrivals existed
        gaps = rng.exponential(1.0 / rate, size=num_requests)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests)
    if num_requests:
        gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


# A trace is the simulator's (``inflight simulate --trace``): one format and one reader for both.
TraceEntry = TraceRequest
