"""What an engine step costs, as a function of its shape: a small linear model fitted to measured steps.

    step seconds = step_s                                   (the fixed cost of any step: launch, host work)
                 + prefill_token_s   x prompt tokens computed
                 + prefill_row_s     x prompt chunks (rows that compute a prompt's tokens)
                 + prefill_pair_s    x prompt attention pairs (each prompt token x the KV it attends to)
                 + decode_row_s      x decode rows
                 + decode_context_s  x KV tokens the decode rows read
                 + sampled_row_s     x rows that sample a token
                 + rebuilt_row_s     x rows of a batch formed anew (not the persistent batch's next step)

Why these terms: a forward reads the weights once (``step_s``) and does per-token matmul work (a prompt token and
a decode row each cost their row of every layer); attention is the part that grows with context (quadratic in a
prompt chunk, linear in a decode row's KV); a prompt chunk has a cost of its own (its attention call, its row's
bookkeeping: on a CPU 16 prompts of 16 tokens take longer than one of 256); sampling is per sampled row; and a
batch the scheduler forms anew costs host work per row that the persistent batch's next step does not
(engine/persistent_batch.py: arrays rebuilt, not updated in place; on this CPU a decode step of traffic whose
running set changed every few steps took 15% longer than the same decode kept). The fit is non-negative least squares on
relative error (a 5 ms decode step is predicted as closely as a 500 ms prefill), so every term means what it says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

TERMS = ("step_s", "prefill_token_s", "prefill_row_s", "prefill_pair_s", "decode_row_s", "decode_context_s",
         "sampled_row_s", "rebuilt_row_s")


def step_features(query_lens: Sequence[int], start_positions: Sequence[int], sample: Sequence[bool],
                  rebuilt: bool = True) -> tuple:
    """A step's shape as the model's inputs, one per term (a ``SchedulerOutput``'s fields: rows' query lengths,
    start positions, whether each samples; ``rebuilt``: not scheduled from the persistent batch). A one-token row
    is a decode (a static batch's padding rows are computed as decodes too)."""
    prefill_tokens = prefill_rows = prefill_pairs = decode_rows = decode_context = 0
    for q, start in zip(query_lens, start_positions):
        if q == 1:
            decode_rows += 1
            decode_context += start + 1
        else:
            prefill_tokens += q
            prefill_rows += 1
            prefill_pairs += q * start + q * (q + 1) // 2
    return (1, prefill_tokens, prefill_rows, prefill_pairs, decode_rows, decode_context, sum(sample),
            len(query_lens) if rebuilt else 0)


@dataclass
class StepCostModel:
    """Seconds per unit of each term (``TERMS``); ``fit_error``: how well it matched the steps it was fitted to."""

    coefficients: dict[str, float]
    fit_error: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = [t for t in TERMS if t not in self.coefficients]
        unknown = [t for t in self.coefficients if t not in TERMS]
        if missing or unknown:
            raise ValueError(f"cost model terms must be {list(TERMS)}: missing {missing}, unknown {unknown}")
        bad = {t: v for t, v in self.coefficients.items() if not (isinstance(v, (int, float)) and 0 <= v < math.inf)}
        if bad:
            raise ValueError(f"cost model terms must be numbers >= 0 (seconds per unit), got {bad}")
        self._weights = np.array([float(self.coefficients[t]) for t in TERMS])
        self._w = tuple(self._weights.tolist())

    def predict(self, features: Sequence[float]) -> float:
        w = self._w
        return (w[0] * features[0] + w[1] * features[1] + w[2] * features[2] + w[3] * features[3]
                + w[4] * features[4] + w[5] * features[5] + w[6] * features[6] + w[7] * features[7])

    def step_seconds(self, query_lens: Sequence[int], start_positions: Sequence[int], sample: Sequence[bool],
                     rebuilt: bool = True) -> float:
        return self.predict(step_features(query_lens, start_positions, sample, rebuilt))

    def to_json(self) -> dict[str, Any]:
        return {"formula": "step seconds = sum of each term's coefficient x its count (serve_app/sim/cost_model.py)",
                "terms": dict(self.coefficients), "fit_error": dict(self.fit_error)}

    @classmethod
    def from_json(cls, record: Any) -> "StepCostModel":
        if not isinstance(record, dict) or not isinstance(record.get("terms"), dict):
            raise ValueError("a profile's cost_model must be an object with 'terms'")
        return cls(dict(record["terms"]), dict(record.get("fit_error") or {}))


def fit(features: Iterable[Sequence[float]], seconds: Iterable[float], outlier_ratio: float = 2.0) -> StepCostModel:
    """Non-negative least squares on relative error over measured steps (``step_features`` rows and their seconds).
    Steps that took more than ``outlier_ratio`` x the fitted time are dropped and the rest refitted (up to three
    rounds): on a shared machine a step that waited for a core says nothing about the step."""
    x = np.asarray(list(features), dtype=np.float64)
    y = np.asarray(list(seconds), dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != len(TERMS) or len(y) != len(x):
        raise ValueError(f"fit needs one row of {len(TERMS)} features per measured step")
    if len(y) < len(TERMS) or not np.all(y > 0):
        raise ValueError(f"fit needs at least {len(TERMS)} steps with positive times, got {len(y)}")
    keep = np.ones(len(y), dtype=bool)
    for _ in range(3):
        weights = _nonnegative_fit(x[keep], y[keep])
        slow = y > outlier_ratio * (x @ weights)
        if not np.any(slow & keep) or np.count_nonzero(keep & ~slow) < len(TERMS):
            break
        keep &= ~slow
    model = StepCostModel(dict(zip(TERMS, weights.tolist())))
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
    active = [i for i in range(len(TERMS)) if np.any(x[:, i])]
    weights = np.zeros(len(TERMS))
    while active:
        solution, *_ = np.linalg.lstsq(rows[:, active] / scale[active], target, rcond=None)
        solution = solution / scale[active]
        if np.all(solution >= 0):
            weights[active] = solution
            break
        active.pop(int(np.argmin(solution)))  # the most negative term goes
    return weights
