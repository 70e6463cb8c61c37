"""When requests arrive: a seeded Poisson or gamma process, or a JSONL trace file.

A trace line is ``{"prompt_tokens": 512, "output_tokens": 128, "arrival_s": 0.25}``: lengths in tokens,
arrival in seconds from the start (lines need not be sorted; ``arrival_s`` defaults to 0).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


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


@dataclass(frozen=True)
class TraceEntry:
    prompt_tokens: int
    output_tokens: int
    arrival_s: float = 0.0


def load_trace(path: str | Path) -> list[TraceEntry]:
    """The entries of a JSONL trace, sorted by arrival. Errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--trace: no such file: {path}")
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"--trace {path}, line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected an object with prompt_tokens, output_tokens, arrival_s")
        for key in ("prompt_tokens", "output_tokens"):
            value = record.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{where}: {key} must be an integer >= 1, got {value!r}")
        arrival = record.get("arrival_s", 0.0)
        if not isinstance(arrival, (int, float)) or isinstance(arrival, bool) or not 0 <= arrival < math.inf:
            raise ValueError(f"{where}: arrival_s must be a number >= 0, got {arrival!r}")
        entries.append(TraceEntry(record["prompt_tokens"], record["output_tokens"], float(arrival)))
    if not entries:
        raise ValueError(f"--trace {path}: the file holds no requests")
    return sorted(entries, key=lambda e: e.arrival_s)
