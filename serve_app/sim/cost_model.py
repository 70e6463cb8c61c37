"""What an engine step costs, as a function of its shape: a small model fitted to measured steps.

    step seconds = step_s                                   (the fixed cost of any step: launch, host work)
                 + prefill_token_s   x prompt tokens computed
                 + prefill_row_s     x prompt chunks (rows that compute a prompt's tokens)
                 + prefill_pair_s    x prompt attention pairs (each prompt token x the KV it attends to)
                 + decode_rows_s(decode rows)               (a curve: below)
                 + decode_context_s  x KV tokens the decode rows read
                 + sampled_row_s     x prompt rows that sample a token (a decode row's sampling: in its curve)
                 + rebuilt_row_s     x rows of a batch formed anew (not the persistent batch's next step)

Why these terms: a forward reads the weights once (``step_s``) and does per-token matmul work (a prompt token and
a decode row each cost their row of every layer); attention is the part that grows with context (quadratic in a
prompt chunk, linear in a decode row's KV); a prompt chunk has a cost of its own (its attention call, its row's
bookkeeping: on a CPU 16 prompts of 16 tokens take longer than one of 256); sampling is per sampled row (a decode
row always samples, so its sampling is part of the decode curve: a separate term would be the same line); and a
batch the scheduler forms anew costs host work per row that the persistent batch's next step does not
(engine/persistent_batch.py: arrays rebuilt, not updated in place; on this CPU a decode step of traffic whose
running set changed every few steps took 15% longer than the same decode kept).

What the decode rows cost is a curve, not a line: its values at the batch sizes a profile measured (``knots``: 1,
2, 4, ... rows), straight between them and on along the last two beyond. Kernels change with the row count: on
this CPU one row's step took 53 ms and two rows' 66 ms, then ~3 ms a row to 16, and 17 rows (oneDNN's path)
less than 16; a line through all of them put the one-row step at 69 ms. A GPU's decode is flat until compute
binds, then steep. A curve of one knot is a line through the origin (``decode_row_s`` x rows).

The fit is non-negative least squares on relative error (a 5 ms decode step is predicted as closely as a 500 ms
prefill), so every term means what it says.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

# the linear terms, one per feature of ``step_features`` but the decode rows (feature 4: the curve)
TERMS = ("step_s", "prefill_token_s", "prefill_row_s", "prefill_pair_s", "decode_context_s", "sampled_row_s",
         "rebuilt_row_s")
_TERM_FEATURES = (0, 1, 2, 3, 5, 6, 7)
_DECODE_ROWS = 4


def step_features(query_lens: Sequence[int], start_positions: Sequence[int], sample: Sequence[bool],
                  rebuilt: bool = True) -> tuple:
    """A step's shape as the model's inputs, one per term (a ``SchedulerOutput``'s fields: rows' query lengths,
    start positions, whether each samples; ``rebuilt``: not scheduled from the persistent batch). A one-token row
    is a decode (a static batch's padding rows are computed as decodes too)."""
    prefill_tokens = prefill_rows = prefill_pairs = decode_rows = decode_context = sampled_prompts = 0
    for q, start, sampled in zip(query_lens, start_positions, sample):
        if q == 1:
            decode_rows += 1
            decode_context += start + 1
        else:
            prefill_tokens += q
            prefill_rows += 1
            prefill_pairs += q * start + q * (q + 1) // 2
            sampled_prompts += sampled
    return (1, prefill_tokens, prefill_rows, prefill_pairs, decode_rows, decode_context, sampled_prompts,
            len(query_lens) if rebuilt else 0)


@dataclass
class StepCostModel:
    """Seconds per unit of each linear term (``TERMS``) and the decode rows' seconds at each knot
    (``decode_rows_s``: {rows: seconds}); ``fit_error``: how well it matched the steps it was fitted to. A
    ``decode_row_s`` among the coefficients stands for the line ``{1: decode_row_s}``."""

    coefficients: dict[str, float]
    fit_error: dict[str, float] = field(default_factory=dict)
    decode_rows_s: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        coefficients = dict(self.coefficients)
        if "decode_row_s" in coefficients:
            if self.decode_rows_s:
                raise ValueError("give decode_row_s (a line) or decode_rows_s (a curve), not both")
            self.decode_rows_s = {1: coefficients.pop("decode_row_s")}
        missing = [t for t in TERMS if t not in coefficients] + ([] if self.decode_rows_s else ["decode_row_s"])
        unknown = [t for t in coefficients if t not in TERMS]
        if missing or unknown:
            raise ValueError(f"cost model terms must be {list(TERMS)} and decode_row_s (or a decode_rows_s curve): "
                             f"missing {missing}, unknown {unknown}")
        values = {**coefficients, **{f"decode_rows_s[{k}]": v for k, v in self.decode_rows_s.items()}}
        bad = {t: v for t, v in values.items() if not (isinstance(v, (int, float)) and 0 <= v < math.inf)}
        if bad:
            raise ValueError(f"cost model terms must be numbers >= 0 (seconds per unit), got {bad}")
        if any(not (isinstance(k, int) and k >= 1) for k in self.decode_rows_s):
            raise ValueError(f"decode_rows_s must map row counts >= 1 to seconds, got {self.decode_rows_s}")
        self.coefficients = coefficients
        self.decode_rows_s = dict(sorted(self.decode_rows_s.items()))
        self._knots = tuple(self.decode_rows_s)
        self._values = tuple(float(v) for v in self.decode_rows_s.values())
        self._w = tuple(float(coefficients[t]) for t in TERMS)
        self._decode_cache: dict[int, float] = {0: 0.0}

    def predict(self, features: Sequence[float]) -> float:
        w = self._w
        rows = features[4]
        decode = self._decode_cache.get(rows)
        if decode is None:
            # beyond the last knot a falling last segment could go below 0: no step is cheaper than no rows
            decode = self._decode_cache[rows] = max(0.0, decode_curve(rows, self._knots, self._values))
        return (w[0] * features[0] + w[1] * features[1] + w[2] * features[2] + w[3] * features[3] + decode
                + w[4] * features[5] + w[5] * features[6] + w[6] * features[7])

    def step_seconds(self, query_lens: Sequence[int], start_positions: Sequence[int], sample: Sequence[bool],
                     rebuilt: bool = True) -> float:
        return self.predict(step_features(query_lens, start_positions, sample, rebuilt))

    def to_json(self) -> dict[str, Any]:
        return {"formula": "step seconds = sum of each term's coefficient x its count + decode_rows_s at the decode "
                           "rows, straight between its points (serve_app/sim/cost_model.py)",
                "terms": dict(self.coefficients), "decode_rows_s": {str(k): v for k, v in self.decode_rows_s.items()},
                "fit_error": dict(self.fit_error)}

    @classmethod
    def from_json(cls, record: Any) -> "StepCostModel":
        if not isinstance(record, dict) or not isinstance(record.get("terms"), dict):
            raise ValueError("a profile's cost_model must be an object with 'terms'")
        curve = record.get("decode_rows_s") or {}
        if not isinstance(curve, dict):
            raise ValueError("a profile's cost_model decode_rows_s must be an object of {rows: seconds}")
        if not all(str(k).isdigit() for k in curve):
            raise ValueError(f"a profile's cost_model decode_rows_s keys must be row counts, got {list(curve)}")
        knots = {int(k): v for k, v in curve.items()}
        return cls(dict(record["terms"]), dict(record.get("fit_error") or {}), knots)


def decode_curve(rows: float, knots: Sequence[int], values: Sequence[float]) -> float:
    """The decode rows' seconds at ``rows``: straight between the ``knots``' ``values``, from 0 at 0 rows to the
    first, and on along the last two beyond the last (one knot: a line through the origin)."""
    if rows <= 0:
        return 0.0
    i = bisect.bisect_left(knots, rows)
    if i < len(knots) and knots[i] == rows:
        return values[i]
    if i == 0 or len(knots) == 1:
        return values[0] * rows / knots[0]
    if i == len(knots):
        i -= 1
    (k0, v0), (k1, v1) = (knots[i - 1], values[i - 1]), (knots[i], values[i])
    return v0 + (v1 - v0) * (rows - k0) / (k1 - k0)


def fit(features: Iterable[Sequence[float]], seconds: Iterable[float], knots: Sequence[int] = (1,),
        outlier_ratio: float = 2.0) -> StepCostModel:
    """Non-negative least squares on relative error over measured steps (``step_features`` rows and their seconds),
    the decode rows' curve through ``knots`` (the row counts measured; ``(1,)``: a line). Steps that took more than
    ``outlier_ratio`` x the fitted time are dropped and the rest refitted (up to three rounds): on a shared machine
    a step that waited for a core says nothing about the step."""
    counts = np.asarray(list(features), dtype=np.float64)
    y = np.asarray(list(seconds), dtype=np.float64)
    knots = sorted(set(int(k) for k in knots))
    if counts.ndim != 2 or counts.shape[1] != len(TERMS) + 1 or len(y) != len(counts):
        raise ValueError(f"fit needs one row of {len(TERMS) + 1} features per measured step")
    if not knots or knots[0] < 1:
        raise ValueError(f"fit needs decode knots >= 1, got {knots}")
    unknowns = len(TERMS) + len(knots)
    if len(y) < unknowns or not np.all(y > 0):
        raise ValueError(f"fit needs at least {unknowns} steps with positive times, got {len(y)}")
    # the curve is linear in its knots' values: a column per knot, its value at each step's rows when that knot's
    # value is 1 and the others' 0
    unit = np.eye(len(knots))
    hats = np.array([[decode_curve(rows, knots, unit[j]) for j in range(len(knots))]
                     for rows in counts[:, _DECODE_ROWS]])
    x = np.hstack([counts[:, list(_TERM_FEATURES)], hats])
    keep = np.ones(len(y), dtype=bool)
    for _ in range(3):
        weights = _nonnegative_fit(x[keep], y[keep])
        slow = y > outlier_ratio * (x @ weights)
        if not np.any(slow & keep) or np.count_nonzero(keep & ~slow) < unknowns:
            break
        keep &= ~slow
    model = StepCostModel(dict(zip(TERMS, weights[:len(TERMS)].tolist())),
                          decode_rows_s=dict(zip(knots, weights[len(TERMS):].tolist())))
    predicted = x[keep] @ weights
    relative = np.abs(predicted - y[keep]) / y[keep]
    model.fit_error = {"steps": int(len(y)), "dropped_slow_steps": int(len(y) - keep.sum()),
                       "median_relative_error": float(np.median(relative)),
                       "p90_relative_error": float(np.percentile(relative, 90)),
                       "total_time_error": float(predicted.sum() / y[keep].sum() - 1.0)}
    return model


def _nonnegative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares of relative error with every weight >= 0: a term the data cannot support (it would come out
    negative) is dropped and the rest refitted."""
    rows = x / y[:, None]  # relative error: each step's equation divided by its own time
    target = np.ones(len(y))
    scale = np.maximum(np.abs(rows).max(axis=0), 1e-30)  # columns of like size, for a well-conditioned solve
    active = [i for i in range(x.shape[1]) if np.any(x[:, i])]
    weights = np.zeros(x.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(rows[:, active] / scale[active], target, rcond=None)
        solution = solution / scale[active]
        if np.all(solution >= 0):
            weights[active] = solution
            break
        active.pop(int(np.argmin(solution)))  # the most negative term goes
    return weights
