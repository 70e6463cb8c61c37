"""What a simulation says: the summary figures, a table for the terminal, and the curves as PNGs."""

from __future__ import annotations

import math
from pathlib import Path
from statistics import fmean
from typing import Any, Sequence

import numpy as np

from inflight.serve_app.sim.fleet import FleetResult, per_request, percentile

LATENCIES = ("ttft", "tpot", "e2e")
SLO_METRICS = tuple(f"{name}_{q}" for name in LATENCIES for q in ("mean", "p50", "p90", "p99"))


def summarize(result: FleetResult) -> dict[str, Any]:
    """The run's figures: output tokens per second over the run (first arrival to last token), and TTFT, TPOT and
    end-to-end latency (mean, p50, p90, p99) over the requests that finished; KV use over time; preemptions."""
    rows = per_request(result)
    span = result.end - result.start - (result.requests[0].trace.arrival_s if result.requests else 0.0)
    summary = latency_summary(rows, span)
    summary["replicas"] = len(result.replicas)
    summary["preemptions"] = result.num_preemptions
    summary["steps"] = sum(r.num_steps for r in result.replicas)
    busy = [r.busy_s / span if span > 0 else math.nan for r in result.replicas]
    summary["replica_busy_fraction"] = busy
    summary["kv"] = kv_utilisation(result)
    return summary


def latency_summary(rows: Sequence[dict[str, Any]], span_s: float) -> dict[str, Any]:
    """The figures of per-request rows (``per_request``'s, or a measured run's alike: ``ttft_s``, ``tpot_s``,
    ``e2e_s``, ``output_tokens``; ``refused``/``unfinished`` for those that did not finish) over ``span_s``, the
    seconds from the first arrival to the last token."""
    done = [r for r in rows if r.get("e2e_s") is not None]
    output_tokens = sum(r["output_tokens"] for r in done)
    summary: dict[str, Any] = {
        "num_requests": len(rows), "num_finished": len(done),
        "num_refused": sum(1 for r in rows if "refused" in r), "num_unfinished": sum(1 for r in rows if "unfinished" in r),
        "duration_s": span_s, "output_tokens": output_tokens,
        "output_tok_per_s": output_tokens / span_s if span_s > 0 else math.nan,
        "request_per_s": len(done) / span_s if span_s > 0 else math.nan,
    }
    for name in LATENCIES:
        values = [r[f"{name}_s"] for r in done if r.get(f"{name}_s") is not None]
        summary[f"mean_{name}_s"] = fmean(values) if values else math.nan
        for q in (50, 90, 99):
            summary[f"p{q}_{name}_s"] = percentile(values, q)
    return summary


def slo_value(summary: dict[str, Any], metric: str) -> float:
    """``ttft_p99`` and the like (``SLO_METRICS``) from a summary."""
    name, q = metric.rsplit("_", 1)
    return summary[f"mean_{name}_s" if q == "mean" else f"{q}_{name}_s"]


def kv_utilisation(result: FleetResult, points: int = 200) -> dict[str, Any]:
    """Each replica's KV blocks in use as a fraction of its pool, time-weighted: the mean, the peak, and a curve of
    ``points`` samples (time from the start, fraction) for plotting."""
    curves, means, peaks = [], [], []
    span = max(result.end - result.start, 1e-9)
    for replica in result.replicas:
        total = replica.scheduler.kv.pool.num_blocks
        times, used = replica.kv_times, replica.kv_used
        if not times:
            curves.append([])
            means.append(0.0)
            peaks.append(0.0)
            continue
        ends = list(times[1:]) + [result.end]
        weighted = sum(u * (e - t) for t, e, u in zip(times, ends, used))
        means.append(weighted / total / span)
        peaks.append(max(used) / total)
        step = max(1, len(times) // points)
        curves.append([(times[i] - result.start, used[i] / total) for i in range(0, len(times), step)])
    return {"mean_fraction": fmean(means) if means else 0.0, "peak_fraction": max(peaks, default=0.0),
            "per_replica_mean": means, "curves": curves}


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], num_left: int = 1) -> str:
    """A plain fixed-width table: the first ``num_left`` columns left-aligned, the rest right-aligned (the
    benchmarks' tables too: benchmarks/common/report.py)."""
    cells = [[format_cell(v) for v in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]

    def line(values):
        return "  ".join(v.ljust(w) if i < num_left else v.rjust(w)
                         for i, (v, w) in enumerate(zip(values, widths))).rstrip()

    return "\n".join([line([str(h) for h in headers]), line(["-" * w for w in widths]), *map(line, cells)])


def format_cell(value: Any) -> str:
    if isinstance(value, (float, np.floating)):
        if value != value:
            return "n/a"
        if abs(value) >= 10_000:
            return f"{value:,.0f}"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    if value is None:
        return ""
    return str(value)


def summary_table(summaries: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """One row per run (its label and summary)."""
    header = ["run", "replicas", "finished", "refused", "out tok/s", "mean TTFT s", "p99 TTFT s", "p99 TPOT s",
              "mean e2e s", "p90 e2e s", "p99 e2e s", "KV mean", "preempt"]
    rows = [[label, s["replicas"], s["num_finished"], s["num_refused"], s["output_tok_per_s"], s["mean_ttft_s"],
             s["p99_ttft_s"], s["p99_tpot_s"], s["mean_e2e_s"], s["p90_e2e_s"], s["p99_e2e_s"],
             f"{s['kv']['mean_fraction']:.0%}", s["preemptions"]] for label, s in summaries]
    return format_table(header, rows)


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plots needs matplotlib (pip install matplotlib, or the inflight[bench] extra)") from None
    return plt


def plot_run(rows: Sequence[dict[str, Any]], summary: dict[str, Any], directory: Path, title: str) -> list[Path]:
    """Latency CDFs (TTFT, TPOT, end to end) and KV use over time, one PNG each."""
    plt = _pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    figure, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for axis, name in zip(axes, LATENCIES):
        values = sorted(r[f"{name}_s"] for r in rows if r.get(f"{name}_s") is not None)
        if values:
            axis.plot(values, [(i + 1) / len(values) for i in range(len(values))])
        axis.set_xlabel(f"{name.upper()} (s)")
        axis.set_ylabel("fraction of requests")
        axis.grid(alpha=0.3)
    figure.suptitle(f"{title}: latency CDFs")
    figure.tight_layout()
    written.append(_save(figure, directory / "latency_cdf.png", plt))
    figure, axis = plt.subplots(figsize=(8, 3.8))
    for i, curve in enumerate(summary["kv"]["curves"]):
        if curve:
            axis.step([t for t, _ in curve], [u for _, u in curve], where="post", label=f"replica {i}", lw=0.8)
    axis.set_xlabel("time (s)")
    axis.set_ylabel("KV blocks in use")
    axis.set_ylim(0, 1.05)
    axis.grid(alpha=0.3)
    if len(summary["kv"]["curves"]) <= 8:
        axis.legend(fontsize=7)
    axis.set_title(f"{title}: KV utilisation")
    figure.tight_layout()
    written.append(_save(figure, directory / "kv_utilisation.png", plt))
    return written


def plot_sweep(points: dict[str, list[tuple[float, dict[str, Any]]]], directory: Path, title: str) -> Path:
    """Throughput against latency as the request rate grows, one curve per batching mode: where continuous
    batching's curve passes static's is the crossover the seed asks operators to find."""
    plt = _pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(1, 2, figsize=(12, 4))
    for mode, runs in points.items():
        rates = [rate for rate, _ in runs]
        axes[0].plot([s["output_tok_per_s"] for _, s in runs], [s["mean_e2e_s"] for _, s in runs], "o-", label=mode)
        axes[1].plot(rates, [s["p99_ttft_s"] for _, s in runs], "o-", label=mode)
    axes[0].set_xlabel("output tokens/s")
    axes[0].set_ylabel("mean end-to-end latency (s)")
    axes[1].set_xlabel("request rate (req/s)")
    axes[1].set_ylabel("p99 TTFT (s)")
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(f"{title}: throughput-latency as the rate grows")
    figure.tight_layout()
    return _save(figure, directory / "sweep.png", plt)


def _save(figure, path: Path, plt) -> Path:
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
