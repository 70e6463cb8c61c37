"""Static vs continuous batching over a range of load: the two throughput-latency curves, where they cross,
and what to run.

``--over rate`` replays the workload at each request rate in ``--values`` (gamma arrivals, ``--burstiness``)
in both modes; ``--over max-num-seqs`` runs it with each number of batch slots, everything arriving at once
(unless ``--rate`` is given). Offline (default), each point is our ``LLMEngine`` on ``--model`` (default
``bench-random``, the random benchmark checkpoint these figures were taken on; ``benchmarks.common.models``) on the
step clock (``benchmarks.common.engine_run``). With ``--serving static=URL,continuous=URL`` a rate sweep instead loads
two running servers, one per mode, through ``benchmarks.serving.serving``.

A point's throughput is useful output tokens/s; its latency is end-to-end (arrival to completion), the
``--latency`` statistic. The modes are compared at each sweep value, by latency for a rate sweep (both
carry the offered load until one saturates) and by throughput for a max-num-seqs sweep; a crossover is
where the lead changes (linear interpolation between sweep values). The recommendation is the point with
the highest throughput within ``--latency-slo-s`` (and, within 5% of that, the lowest latency), with a
token budget that fits every slot's decode plus a p90 prompt.

    python -m benchmarks.offline.sweep --over rate --values 1,2,3,4,6 --plot docs/images/sweep.png
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from benchmarks.common.arrivals import arrival_times
from benchmarks.common.engine import add_engine_args, make_engine
from benchmarks.common.engine_run import run_engine
from benchmarks.common.flags import comma_separated, positive_float, positive_int
from benchmarks.common.metrics import (
    SLO, CurveComparison, OperatingPoint, compare_curves, interpolate, pick_operating_point, recommend_token_budget,
    summarize,
)
from benchmarks.common.models import RANDOM, add_model_arg, model_from_args
from benchmarks.common.report import describe_machine, load_average, print_table, pyplot, save_figure, write_json
from benchmarks.common.workloads import BenchRequest, add_workload_args, describe_workload, workload_from_args

MODES = ("static", "continuous")


@dataclass
class Point:
    mode: str
    param: float
    tokens_per_s: float
    latency_s: dict[str, float]  # mean, p50, p90, p99
    ttft_s: dict[str, float]
    peak_running: int | None = None
    num_preemptions: int | None = None
    num_failed: int = 0
    kv_diagnosis: str | None = None

    def latency(self, statistic: str) -> float:
        return self.latency_s[statistic]


# -- one point ------------------------------------------------------------------------------------------
def offline_point(model_path: str, mode: str, param: float, requests: Sequence[BenchRequest], args) -> Point:
    if args.over == "rate":
        arrivals = arrival_times(len(requests), param, args.burstiness, args.seed)
        engine = make_engine(model_path, mode, args)
    else:
        arrivals = arrival_times(len(requests), args.rate, args.burstiness, args.seed) if args.rate else None
        engine = make_engine(model_path, mode, args, max_num_seqs=int(param))
    run = run_engine(engine, requests, arrivals, desc=f"{mode} {args.over} {param:g}")
    diagnosis = run.diagnosis()
    return Point(mode, param, run.tokens_per_s, summarize(run.latencies_s), summarize(run.ttfts_s),
                 max(s.num_running for s in run.steps), run.num_preemptions, 0,
                 diagnosis.message if diagnosis else None)


def serving_point(url: str, mode: str, rate: float, requests: Sequence[BenchRequest], args) -> Point:
    from benchmarks.serving.serving import LoadRequest, first_model, run_load, summarize_load

    model = asyncio.run(first_model(url, args.timeout_s))
    load = [LoadRequest(r.prompt_token_ids, r.max_tokens, r.ignore_eos) for r in requests]
    arrivals = arrival_times(len(load), rate, args.burstiness, args.seed)
    results, duration = asyncio.run(run_load(url, model, load, arrivals, None, {"temperature": 0.0, "ignore_eos": True},
                                             args.timeout_s, desc=f"{mode} rate {rate:g}"))
    summary = summarize_load(results, duration, SLO())
    return Point(mode, rate, summary["output_tokens_per_s"], summary["e2e_s"], summary["ttft_s"],
                 num_failed=summary["num_requests"] - summary["num_ok"])


def median_point(repeats: list[Point], args) -> Point:
    """The repeat whose compared value is the median (the lower middle one of an even count): one real run,
    so its throughput and latency belong together, and a run hit by another process's load is left out."""
    return sorted(repeats, key=lambda p: compared_value(p, args))[(len(repeats) - 1) // 2]


# -- the comparison --------------------------------------------------------------------------------------
def compared_value(point: Point, args) -> float:
    """What decides who is better: latency in a rate sweep (lower is better), throughput otherwise (higher)."""
    return point.latency(args.latency) if args.over == "rate" else point.tokens_per_s


def compare(points: dict[str, list[Point]], args) -> CurveComparison:
    values = {mode: [compared_value(p, args) for p in points[mode]] for mode in MODES}
    return compare_curves(args.values, values["static"], values["continuous"], MODES,
                          higher_is_better=args.over != "rate")


def describe_comparison(comparison: CurveComparison, args) -> list[str]:
    what = "lower " + args.latency + " latency" if args.over == "rate" else "higher throughput"
    unit = " req/s" if args.over == "rate" else ""
    lines = []
    for crossover in comparison.crossovers:
        lines.append(f"crossover at {args.over} ~ {crossover.param:.3g}{unit}: {crossover.before} leads below, "
                     f"{crossover.after} above ({what})")
    static_ranges = comparison.ranges_won_by("static", args.values)
    if static_ranges:
        spans = ", ".join(f"{lo:.3g}-{hi:.3g}{unit}" for lo, hi in static_ranges)
        lines.append(f"static batching is better ({what}) for {args.over} in {spans}")
    elif not comparison.crossovers:
        leader = next((w for w in comparison.winners if w != "tie"), "neither")
        lines.append(f"no crossover in this range: {leader} leads at every {args.over} ({what})")
    return lines


def recommend(points: dict[str, list[Point]], requests: Sequence[BenchRequest], args) -> dict[str, Any] | None:
    candidates = [OperatingPoint(p.mode, p.param, p.tokens_per_s, p.latency(args.latency))
                  for mode in MODES for p in points[mode] if p.num_failed == 0]
    best = pick_operating_point(candidates, args.latency_slo_s)
    if best is None:
        return None
    chosen = next(p for p in points[best.mode] if p.param == best.param)
    if args.over == "max-num-seqs":
        slots = int(best.param)
    else:
        slots = args.static_batch_size if best.mode == "static" else args.max_num_seqs
    budget = recommend_token_budget([r.prompt_len for r in requests], slots)
    return {"mode": best.mode, "max_num_seqs": slots, "max_num_batched_tokens": budget, "at": best.param,
            "tokens_per_s": best.throughput, "latency_s": best.latency_s, "peak_running": chosen.peak_running,
            "kv_diagnosis": chosen.kv_diagnosis}


# -- report ---------------------------------------------------------------------------------------------
def print_report(points: dict[str, list[Point]], comparison: CurveComparison, advice: dict[str, Any] | None,
                 args) -> None:
    rows = []
    for i, value in enumerate(args.values):
        for mode in MODES:
            p = points[mode][i]
            rows.append([f"{value:g}", mode, p.tokens_per_s, p.latency_s["mean"], p.latency_s["p50"],
                         p.latency_s["p90"], p.latency_s["p99"], p.ttft_s["p90"],
                         "" if p.peak_running is None else p.peak_running,
                         "" if p.num_preemptions is None else p.num_preemptions, p.num_failed,
                         "<- better" if comparison.winners[i] == mode else ""])
    print_table(f"sweep over {args.over}: end-to-end latency in seconds (median of {args.repeats} repeats)",
                [args.over, "mode", "useful tok/s", "lat mean", "p50", "p90", "p99", "TTFT p90", "peak running",
                 "preempted", "failed", f"by {'latency ' + args.latency if args.over == 'rate' else 'throughput'}"],
                rows, num_left=2)
    print()
    for line in describe_comparison(comparison, args):
        print(line)
    if advice is None:
        print(f"recommendation: no point met --latency-slo-s {args.latency_slo_s}; lower the load or relax the SLO")
        return
    where = f"{args.over} {advice['at']:g}"
    print(f"recommendation for this workload: {advice['mode']} batching, max_num_seqs {advice['max_num_seqs']}, "
          f"max_num_batched_tokens {advice['max_num_batched_tokens']} (best point: {where}, "
          f"{advice['tokens_per_s']:.0f} tok/s at {args.latency} latency {advice['latency_s']:.2f} s"
          + (f", at most {advice['peak_running']} requests running" if advice["peak_running"] is not None else "")
          + ")")
    for mode in MODES:  # at the highest load, where a configuration's limits show
        top = points[mode][-1]
        if top.kv_diagnosis:
            print(f"KV diagnosis, {mode} at {args.over} {top.param:g}: {top.kv_diagnosis}")


def plot(points: dict[str, list[Point]], comparison: CurveComparison, args, path: str) -> None:
    plt = pyplot()
    fig, (curves, lead) = plt.subplots(1, 2, figsize=(13, 4.8))
    colours = {"static": "C1", "continuous": "C0"}
    labels = {mode: mode for mode in MODES}
    if args.over == "rate" and not args.serving:
        labels = {"static": f"static ({args.static_batch_size} slots)",
                  "continuous": f"continuous (max_num_seqs {args.max_num_seqs})"}
    for mode in MODES:
        xy = [(p.tokens_per_s, p.latency(args.latency)) for p in points[mode]]
        curves.plot(*zip(*xy), "o-", color=colours[mode], label=labels[mode])
        for (x, y), value in zip(xy, args.values):
            curves.annotate(f"{value:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8,
                            color=colours[mode])
    metric = [compared_value(p, args) for p in points["static"]]
    for mode in MODES:
        values = [compared_value(p, args) for p in points[mode]]
        lead.plot(args.values, values, "o-", color=colours[mode], label=labels[mode])
    for lo, hi in comparison.ranges_won_by("static", args.values):
        lead.axvspan(lo, hi, color=colours["static"], alpha=0.12, label="static better")
    for c in comparison.crossovers:
        for mode in MODES:
            xy = [(p.tokens_per_s, p.latency(args.latency)) for p in points[mode]]
            x, y = interpolate(xy, c.index, c.fraction)
            curves.plot([x], [y], marker="*", markersize=16, color="black", zorder=5)
        curves.annotate(f"crossover\n{args.over} ~ {c.param:.3g}", (x, y), textcoords="offset points",
                        xytext=(-70, 20), fontsize=9, arrowprops={"arrowstyle": "->"})
        lead.axvline(c.param, color="black", linestyle="--")
        lead.annotate(f"{c.param:.3g}", (c.param, min(metric)), textcoords="offset points", xytext=(4, 0),
                      fontsize=9)
    curves.set_xlabel("useful output tokens/s")
    curves.set_ylabel(f"{args.latency} end-to-end latency, s")
    curves.set_title(f"throughput-latency, labels: {args.over}; {args.name}")
    curves.legend()
    lead.set_xlabel(args.over + (" (requests/s)" if args.over == "rate" else ""))
    lead.set_ylabel(f"{args.latency} latency, s" if args.over == "rate" else "useful output tokens/s")
    lead.set_title("who leads at each sweep value (crossover dashed)")
    handles, labels = lead.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    lead.legend(unique.values(), unique.keys())
    save_figure(fig, path)


def _load(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


# -- main -----------------------------------------------------------------------------------------------
def parse_values(text: str) -> list[float]:
    values = comma_separated(text, float)
    if len(values) < 2 or any(not v > 0 for v in values) or any(b <= a for a, b in zip(values, values[1:])):
        raise argparse.ArgumentTypeError(f"expected at least 2 increasing numbers > 0, got {text!r}")
    return values


def parse_serving(text: str) -> dict[str, str]:
    pairs = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
    if set(pairs) != set(MODES):
        raise argparse.ArgumentTypeError(f"expected static=URL,continuous=URL, got {text!r}")
    return {mode: url.rstrip("/") for mode, url in pairs.items()}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.offline.sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(parser, default=RANDOM, what=" our engine runs offline (with --serving: whose tokens the prompts "
                                               "are)")
    add_workload_args(parser, num_requests=32)
    add_engine_args(parser)
    parser.add_argument("--over", choices=["rate", "max-num-seqs"], default="rate", help="what the sweep varies")
    parser.add_argument("--values", type=parse_values, default=None,
                        help="sweep values, comma-separated and increasing (default: 1,2,3,4,6 req/s for rate, "
                             "1,2,4,8,16 for max-num-seqs)")
    parser.add_argument("--rate", type=float, help="max-num-seqs sweep: arrivals at this rate instead of all at once")
    parser.add_argument("--burstiness", type=positive_float, default=1.0, help="gamma shape of arrival gaps (1: Poisson)")
    parser.add_argument("--latency", choices=["mean", "p50", "p90", "p99"], default="p90",
                        help="which end-to-end latency statistic the curves show and compare")
    parser.add_argument("--latency-slo-s", type=float, help="recommend only points with latency at most this")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="runs per point, modes interleaved; the median run is kept (this machine is shared)")
    parser.add_argument("--serving", type=parse_serving, metavar="static=URL,continuous=URL",
                        help="sweep two running servers (one per mode) over rates instead of our engine offline")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per-request HTTP timeout (--serving)")
    parser.add_argument("--json", metavar="PATH", help="also write every point as JSON here")
    parser.add_argument("--plot", metavar="PATH.png", default="sweep.png", help="where the curves go")
    args = parser.parse_args(argv)
    if args.values is None:
        args.values = [1.0, 2.0, 3.0, 4.0, 6.0] if args.over == "rate" else [1.0, 2.0, 4.0, 8.0, 16.0]
    if args.over == "max-num-seqs" and any(v != int(v) for v in args.values):
        parser.error(f"--values: max-num-seqs takes whole numbers, got {args.values}")
    if args.serving and args.over != "rate":
        parser.error("--serving: a server's max_num_seqs is fixed by its config; sweep --over rate")
    if args.rate is not None and not args.rate > 0:
        parser.error(f"--rate must be > 0, got {args.rate}")
    if args.trace:
        parser.error("--trace: a sweep makes its own arrivals; replay a trace with benchmarks.offline.offline")
    args.bench_model = model_from_args(parser, args)
    args.requests, _, args.name = workload_from_args(parser, args, args.bench_model)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    requests = args.requests
    torch.set_num_threads(args.threads)
    model_path = None if args.serving else args.bench_model.engine_model
    points: dict[str, list[Point]] = {mode: [] for mode in MODES}
    load_start = load_average()
    for value in args.values:
        repeats: dict[str, list[Point]] = {mode: [] for mode in MODES}
        for _ in range(args.repeats):
            for mode in MODES:  # interleaved, so a burst of load elsewhere hits both modes alike
                if args.serving:
                    point = serving_point(args.serving[mode], mode, value, requests, args)
                else:
                    point = offline_point(model_path, mode, value, requests, args)
                repeats[mode].append(point)
                print(f"{args.over} {value:g}, {mode}: {point.tokens_per_s:.0f} tok/s, {args.latency} latency "
                      f"{point.latency(args.latency):.2f} s", file=sys.stderr, flush=True)
        for mode in MODES:
            points[mode].append(median_point(repeats[mode], args))
    comparison = compare(points, args)
    advice = recommend(points, requests, args)
    print_report(points, comparison, advice, args)
    print(f"load average {_load(load_start)} at start, {_load(load_average())} at end (2-core machine, shared)")
    plot(points, comparison, args, args.plot)
    write_json(args.json, {
        "benchmark": "sweep", "over": args.over, "values": args.values, "latency": args.latency,
        "workload_name": args.name, "workload": describe_workload(requests),
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "requests", "bench_model")},
        "model": args.bench_model.describe(),
        "machine": {**describe_machine(), "load_average_start": load_start}, "points": points, "winners": comparison.winners,
        "crossovers": comparison.crossovers, "messages": describe_comparison(comparison, args),
        "recommendation": advice,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
