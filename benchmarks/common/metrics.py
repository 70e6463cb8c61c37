"""The arithmetic behind every benchmark report: percentiles, streaming latencies, goodput, padding,
per-step summaries, crossovers between two curves, and the KV-utilisation diagnosis.

Pure functions on plain numbers (no engine, no HTTP), so each formula is tested on hand-made traces
in ``tests/benchmarks/``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

# The KV diagnosis lives with the engine, which applies it to its own steps too; re-exported for the benchmarks.
from inflight.engine.kv_diagnosis import (  # noqa: F401
    CAUSES, KV_UTILISATION_THRESHOLD, MIN_WAITING_SHARE, EngineLimits, KVDiagnosis, StepSample, diagnose_kv,
)

PERCENTILES = (50, 90, 99)


# -- distributions ------------------------------------------------------------------------------------
def percentile(values: Iterable[float], p: float) -> float:
    """The p-th percentile with linear interpolation between order statistics (numpy's default); nan if empty."""
    array = np.asarray(list(values), dtype=np.float64)
    if array.size == 0:
        return float("nan")
    return float(np.percentile(array, p))


def summarize(values: Iterable[float], percentiles: Sequence[int] = PERCENTILES) -> dict[str, float]:
    """``{"mean", "p50", "p90", "p99"}`` (or the percentiles asked for); nan everywhere if empty."""
    array = np.asarray(list(values), dtype=np.float64)
    mean = float(array.mean()) if array.size else float("nan")
    return {"mean": mean, **{f"p{p}": percentile(array, p) for p in percentiles}}


# -- one streamed request ---------------------------------------------------------------------------------
def time_per_output_token(ttft_s: float, e2e_s: float, num_output_tokens: int) -> float | None:
    """TPOT: the time after the first token, spread over the tokens after it. None with fewer than 2 tokens."""
    if num_output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (num_output_tokens - 1)


def inter_token_latencies(chunk_times_s: Sequence[float]) -> list[float]:
    """ITL: the gaps between consecutive content chunks (a chunk may carry several tokens when a server batches
    its messages; the gaps are then what a client sees)."""
    return [b - a for a, b in zip(chunk_times_s, chunk_times_s[1:])]


# -- goodput --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SLO:
    """Latency limits in seconds; None means no limit. A request meets the SLO when it succeeded and every
    limit it can be measured against holds (TPOT cannot be measured on a one-token output, so it holds)."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    @property
    def is_empty(self) -> bool:
        return self.ttft_s is None and self.tpot_s is None and self.e2e_s is None

    def met_by(self, ttft_s: float | None, tpot_s: float | None, e2e_s: float | None) -> bool:
        for limit, value in ((self.ttft_s, ttft_s), (self.e2e_s, e2e_s)):
            if limit is not None and (value is None or value > limit):
                return False
        return self.tpot_s is None or tpot_s is None or tpot_s <= self.tpot_s


@dataclass(frozen=True)
class RequestLatency:
    """What goodput needs of one request; ``ok`` is False for a request that failed (any error, 429 included)."""

    ok: bool
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None


def goodput(requests: Sequence[RequestLatency], slo: SLO, duration_s: float) -> tuple[float, float]:
    """(requests per second that succeeded within the SLO, their share of all requests)."""
    if not requests or duration_s <= 0:
        return float("nan"), float("nan")
    good = sum(r.ok and slo.met_by(r.ttft_s, r.tpot_s, r.e2e_s) for r in requests)
    return good / duration_s, good / len(requests)


# -- padding and waste ------------------------------------------------------------------------------------
def useful_computed_tokens(prompt_lens: Sequence[int], output_lens: Sequence[int]) -> int:
    """Tokens a perfect engine computes: each prompt token once, and each output token but the last fed back once."""
    return int(sum(prompt_lens) + sum(max(n - 1, 0) for n in output_lens))


def padded_static_batch_tokens(prompt_lens: Sequence[int], output_lens: Sequence[int], batch_size: int) -> int:
    """Tokens computed by left-padded static batches (transformers' ``generate``) formed in arrival order: every
    row is computed to the batch's longest prompt, then for as many steps as the batch's longest output."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    total = 0
    for start in range(0, len(prompt_lens), batch_size):
        prompts, outputs = prompt_lens[start:start + batch_size], output_lens[start:start + batch_size]
        total += len(prompts) * (max(prompts) + max(max(outputs) - 1, 0))
    return total


@dataclass(frozen=True)
class TokenWaste:
    """``padding``: computed only to keep a batch's shape; ``wasted``: every computed token beyond the useful
    ones (padding plus recomputation after preemption)."""

    computed: int
    useful: int
    padding: int

    @property
    def wasted(self) -> int:
        return self.computed - self.useful

    @property
    def wasted_share(self) -> float:
        return self.wasted / self.computed if self.computed else float("nan")


# -- per-step summaries (our engine) ------------------------------------------------------------------------
def summarize_steps(steps: Sequence[StepSample], limits: EngineLimits) -> dict[str, float]:
    """Time by step kind, batch occupancy and KV utilisation, each averaged over steps.

    Occupancy is the share of the ``max_num_seqs`` slots held by requests that are not done (static
    padding rows do not count).
    KV utilisation is block-level (blocks held / all blocks) and token-level (tokens with KV / all token
    slots): the gap between the two is space held but not filled.
    """
    def mean(values):
        return float(np.mean(values)) if steps else float("nan")

    time_by_kind = {kind: sum(s.duration_s for s in steps if s.kind == kind) for kind in ("prefill", "decode", "mixed")}
    return {
        "num_steps": len(steps),
        "prefill_s": time_by_kind["prefill"],
        "decode_s": time_by_kind["decode"],
        "mixed_s": time_by_kind["mixed"],
        "mean_active_requests": mean([s.num_running - s.num_padding_rows for s in steps]),
        "mean_occupancy": mean([(s.num_running - s.num_padding_rows) / limits.max_num_seqs for s in steps]),
        "kv_block_utilisation": mean([s.kv_blocks_used / limits.kv_blocks_total for s in steps]),
        "kv_token_utilisation": mean([s.kv_tokens_used / limits.kv_tokens_total for s in steps]),
        "padding_tokens": sum(s.num_padding_rows for s in steps),
        "computed_tokens": sum(s.num_tokens for s in steps),
    }


# -- two curves ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Crossover:
    """Where the lead between two curves changes, between sweep points ``index`` and ``index + 1``.

    ``fraction`` places it on that segment (0 at ``index``), found by linear interpolation of the difference
    of the compared values; ``param`` is the sweep value there.
    """

    index: int
    fraction: float
    param: float
    before: str  # the curve that was better below param
    after: str


@dataclass(frozen=True)
class CurveComparison:
    winners: list[str]  # per sweep point: a name, or "tie"
    crossovers: list[Crossover]

    def ranges_won_by(self, name: str, params: Sequence[float]) -> list[tuple[float, float]]:
        """The sweep-value intervals over which ``name`` leads (ends at crossovers or at the sweep's ends)."""
        bounds = [params[0], *(c.param for c in self.crossovers), params[-1]]
        leaders = [c.before for c in self.crossovers] + ([self.crossovers[-1].after] if self.crossovers else [])
        if not self.crossovers:
            decided = [w for w in self.winners if w != "tie"]
            leaders = [decided[0] if decided else "tie"]
        return [(lo, hi) for lo, hi, who in zip(bounds, bounds[1:], leaders) if who == name]


def compare_curves(params: Sequence[float], a: Sequence[float], b: Sequence[float], names: tuple[str, str],
                   higher_is_better: bool) -> CurveComparison:
    """Which of two curves sampled at the same sweep values is better at each, and where the lead changes.

    A tie at a sweep point does not end a lead; a crossover lies where the difference a - b, interpolated
    linearly between the last point one curve led and the first point the other leads, is zero.
    """
    if not len(params) == len(a) == len(b):
        raise ValueError(f"params, a and b must have the same length, got {len(params)}, {len(a)}, {len(b)}")
    if any(q <= p for p, q in zip(params, params[1:])):
        raise ValueError("params must be strictly increasing")
    sign = 1.0 if higher_is_better else -1.0
    diffs = [sign * (x - y) for x, y in zip(a, b)]  # > 0: a is better
    winners = [names[0] if d > 0 else names[1] if d < 0 else "tie" for d in diffs]
    crossovers = []
    last = None  # index of the last point with a leader
    for i, d in enumerate(diffs):
        if d == 0 or math.isnan(d):
            continue
        if last is not None and (d > 0) != (diffs[last] > 0):
            t = diffs[last] / (diffs[last] - d)  # where the line from (last, d_last) to (i, d) is zero
            param = params[last] + t * (params[i] - params[last])
            index = max(j for j in range(last, i) if params[j] <= param)
            fraction = (param - params[index]) / (params[index + 1] - params[index])
            crossovers.append(Crossover(index, fraction, param, winners[last], winners[i]))
        last = i
    return CurveComparison(winners, crossovers)


def interpolate(points: Sequence[tuple[float, float]], index: int, fraction: float) -> tuple[float, float]:
    """The point ``fraction`` of the way from ``points[index]`` to ``points[index + 1]``."""
    (x0, y0), (x1, y1) = points[index], points[index + 1]
    return x0 + fraction * (x1 - x0), y0 + fraction * (y1 - y0)


# -- recommendation --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OperatingPoint:
    mode: str
    param: float  # the sweep value (a request rate, or max_num_seqs)
    throughput: float
    latency_s: float


def pick_operating_point(points: Sequence[OperatingPoint], latency_slo_s: float | None = None,
                         tolerance: float = 0.05) -> OperatingPoint | None:
    """The best point: within the latency SLO (if any), throughput within ``tolerance`` of the best, and of
    those the lowest latency. None if no point meets the SLO."""
    allowed = [p for p in points if latency_slo_s is None or p.latency_s <= latency_slo_s]
    if not allowed:
        return None
    best = max(p.throughput for p in allowed)
    close = [p for p in allowed if p.throughput >= (1 - tolerance) * best]
    return min(close, key=lambda p: (p.latency_s, p.param))


def recommend_token_budget(prompt_lens: Sequence[int], max_num_seqs: int, multiple: int = 256) -> int:
    """A step should hold every running request's decode plus one typical (p90) prompt, so prefills are not
    cut into chunks while decodes wait; rounded up to ``multiple``."""
    needed = max_num_seqs + percentile(prompt_lens, 90)
    return int(math.ceil(needed / multiple) * multiple)
