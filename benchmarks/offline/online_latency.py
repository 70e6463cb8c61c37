"""Online latency: continuous vs static batching under a Poisson arrival trace.

What is measured:

1. Static mode's offline capacity C (requests/s): the workload (default: the seed's 64 requests,
   prompts of 50-800 random tokens, 20-200 output tokens each, greedy, eos ignored) submitted at once
   to ``LLMEngine(batching="static")``; C = requests / span. ``--capacity`` skips this step.
2. A Poisson arrival trace at ``--rate-fraction`` x C (default half), seeded, for the same requests;
   the same trace and requests for both modes.
3. The trace is replayed through ``LLMEngine`` in each mode on the step clock (``benchmarks.common.engine_run``:
   requests join when their arrival time has come, idle gaps are skipped rather than slept), so
   queueing is part of latency.

On ``--model`` (default ``bench-random``, the random benchmark checkpoint these figures were taken on; the real
``smollm2-135m-instruct``, a .gguf file...: ``benchmarks.common.models``).

Reported per mode: mean/p50/p90/p99 end-to-end latency (arrival to completion) and time to first
token, and the ratio of mean latencies continuous / static, whose target is <= 0.43. Same KV budget
as the offline benchmark: 8,000 tokens (500 blocks of 16).

    python -m benchmarks.offline.online_latency [--num-requests 64] [--rate-fraction 0.5] [--capacity REQ_PER_S]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

import torch

from benchmarks.common.arrivals import arrival_times
from benchmarks.common.engine import add_engine_args, make_engine
from benchmarks.common.engine_run import EngineRun, run_engine
from benchmarks.common.flags import positive_float
from benchmarks.common.metrics import summarize
from benchmarks.common.models import RANDOM, add_model_arg, model_from_args
from benchmarks.common.report import describe_machine, load_average, print_table, write_json
from benchmarks.common.workloads import add_workload_args, describe_workload, workload_from_args

MODES = ("continuous", "static")
TARGET_MEAN_RATIO = 0.43  # continuous mean latency / static mean latency must be <= this


def print_report(results: dict[str, EngineRun], capacity: float, rate: float, workload: dict,
                 loads: tuple[float | None, float | None], args) -> dict[str, Any]:
    load = ["n/a" if v is None else f"{v:.2f}" for v in loads]
    print(f"\nstatic capacity {capacity:.3f} req/s; Poisson arrivals at {rate:.3f} req/s; "
          f"{workload['num_requests']} requests, {workload['prompt_tokens']} prompt tokens, "
          f"{workload['output_tokens']} output tokens; KV budget {args.kv_budget_tokens} tokens; "
          f"torch threads {torch.get_num_threads()}; load average {load[0]} at start, {load[1]} at end")
    rows = []
    for mode, run in results.items():
        for metric, values in (("e2e latency", run.latencies_s), ("TTFT", run.ttfts_s)):
            s = summarize(values)
            rows.append([mode, metric, s["mean"], s["p50"], s["p90"], s["p99"], run.span_s])
    print_table("latency, seconds", ["mode", "metric", "mean", "p50", "p90", "p99", "span s"], rows, num_left=2)
    if not all(m in results for m in MODES):
        return {}
    value = summarize(results["continuous"].latencies_s)["mean"] / summarize(results["static"].latencies_s)["mean"]
    verdict = {"ratio": "continuous_mean/static_mean", "value": value, "target": TARGET_MEAN_RATIO,
               "met": value <= TARGET_MEAN_RATIO}
    print_table("ratio of mean e2e latency", ["ratio", "value", "target", "result"],
                [[verdict["ratio"], value, f"<= {TARGET_MEAN_RATIO}", "met" if verdict["met"] else "MISSED"]])
    return verdict


def parse_args(argv: Sequence[str] | None = None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.offline.online_latency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(parser, default=RANDOM)
    add_workload_args(parser)
    add_engine_args(parser)
    parser.add_argument("--rate-fraction", type=positive_float, default=0.5,
                        help="arrival rate as a fraction of static mode's offline capacity")
    parser.add_argument("--capacity", type=positive_float,
                        help="static mode's offline capacity in requests/s; None: measure it first")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or set(args.modes) - set(MODES):
        parser.error(f"--modes: choose from {','.join(MODES)}")
    if args.trace:
        parser.error("--trace: this benchmark makes its own arrivals; replay a trace with benchmarks.offline.offline")
    args.bench_model = model_from_args(parser, args)
    requests, _, _ = workload_from_args(parser, args, args.bench_model)
    return args, requests


def main(argv: Sequence[str] | None = None) -> int:
    args, requests = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_path = args.bench_model.engine_model
    load_start = load_average()
    capacity = args.capacity
    if capacity is None:
        print("measuring static capacity ...", file=sys.stderr, flush=True)
        run = run_engine(make_engine(model_path, "static", args), requests, desc="static capacity")
        capacity = len(requests) / run.span_s
        print(f"static capacity: {capacity:.3f} req/s", file=sys.stderr, flush=True)
    rate = capacity * args.rate_fraction
    arrivals = arrival_times(len(requests), rate, seed=args.seed)
    results: dict[str, EngineRun] = {}
    for mode in args.modes:
        print(f"replaying the trace ({arrivals[-1]:.1f} s of arrivals) in {mode} mode ...", file=sys.stderr,
              flush=True)
        results[mode] = run_engine(make_engine(model_path, mode, args), requests, arrivals, desc=mode)
    workload = describe_workload(requests)
    loads = (load_start, load_average())
    verdict = print_report(results, capacity, rate, workload, loads, args)
    write_json(args.json, {
        "benchmark": "online_latency",
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "bench_model")},
        "model": args.bench_model.describe(),
        "machine": {**describe_machine(), "load_average_start": loads[0], "load_average_end": loads[1]},
        "capacity_req_per_s": capacity, "capacity_measured": args.capacity is None, "rate_req_per_s": rate,
        "workload": workload, "arrivals_s": arrivals,
        "results": {mode: run.summary() for mode, run in results.items()},
        "latencies_s": {mode: run.latencies_s for mode, run in results.items()},
        "ttfts_s": {mode: run.ttfts_s for mode, run in results.items()},
        "ratio": verdict,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
