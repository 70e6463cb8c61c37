"""How far ``inflight simulate`` is from a measured run of the same trace: the figures compared, their errors, and
the trace both sides run (the benchmark's requests as ``TraceRequest``s)."""

from __future__ import annotations

import math
from typing import Any, Sequence

from benchmarks.common.report import print_table
from inflight.serve_app.sim.trace import TraceRequest

# figure -> the bound its relative error must stay within (issue 44's acceptance)
OFFLINE_BOUNDS = {"output_tok_per_s": 0.10, "mean_e2e_s": 0.10, "p90_e2e_s": 0.15}
SERVING_BOUNDS = {"output_tok_per_s": 0.15, "mean_ttft_s": 0.15}
SHOWN = ("output_tok_per_s", "mean_ttft_s", "mean_e2e_s", "p90_e2e_s", "p99_e2e_s")


def trace_of(requests, arrivals_s: Sequence[float]) -> list[TraceRequest]:
    """The benchmark's requests (``BenchRequest``s or ``LoadRequest``s: prompts, max_tokens) as the simulator's
    trace: lengths and arrival times (the simulator makes its own tokens: no prompt here shares a prefix)."""
    return [TraceRequest(len(r.prompt_token_ids), r.max_tokens, float(a)) for r, a in zip(requests, arrivals_s)]


def errors(measured: dict[str, Any], simulated: dict[str, Any], figures: Sequence[str] = SHOWN) -> dict[str, float]:
    """(simulated - measured) / measured of each figure."""
    out = {}
    for name in figures:
        m, s = measured.get(name), simulated.get(name)
        out[name] = (s - m) / m if m and s is not None and math.isfinite(m) and math.isfinite(s) else math.nan
    return out


def mean_of(summaries: Sequence[dict[str, Any]], figures: Sequence[str] = SHOWN) -> dict[str, Any]:
    """Each figure's mean over repeated measured runs, and its spread (max - min) / mean as ``spread_<figure>``:
    the machine's own noise, which no prediction can beat."""
    out: dict[str, Any] = {}
    for name in figures:
        values = [s[name] for s in summaries if s.get(name) is not None and math.isfinite(s[name])]
        if values:
            mean = sum(values) / len(values)
            out[name] = mean
            out[f"spread_{name}"] = (max(values) - min(values)) / mean if mean else math.nan
    return out


def within(errors_by_run: dict[str, dict[str, float]], bounds: dict[str, float]) -> dict[str, bool]:
    """For each run, whether every bounded figure's error is within its bound."""
    return {run: all(abs(e[name]) <= bound for name, bound in bounds.items()) for run, e in errors_by_run.items()}


def print_comparison(title: str, rows: Sequence[tuple[str, dict[str, Any], dict[str, Any]]],
                     bounds: dict[str, float]) -> None:
    """One block of rows per run: measured, simulated, error (bounded figures marked with their bound)."""
    header = ["run", "side", *(f"{name} (<= {bounds[name]:.0%})" if name in bounds else name for name in SHOWN)]
    table = []
    for label, measured, simulated in rows:
        table.append([label, "measured", *(measured.get(name) for name in SHOWN)])
        table.append(["", "simulated", *(simulated.get(name) for name in SHOWN)])
        table.append(["", "error", *(f"{e:+.1%}" if math.isfinite(e) else "-"
                                     for e in errors(measured, simulated).values())])
    print_table(title, header, table, num_left=2)
