"""Online latency: continuous vs static batching under a Poisson arrival trace, in real time.

What is measured:

1. Static mode's offline capacity C (requests/s): the seed workload (default 64 requests, prompts
   of 50-800 random tokens, 20-200 output tokens each, greedy, eos ignored) submitted at once to
   ``LLMEngine(batching="static")``; C = requests / wall time. ``--capacity`` skips this step.
2. A Poisson arrival trace at ``--rate-fraction`` x C (default half), seeded, for the same seed
   workload; the same trace and requests for both modes.
3. The trace is replayed in real time through ``LLMEngine`` in each mode: a loop adds every request
   whose arrival time has come (passing ``arrival_time``, so queueing counts), calls ``step()``
   whenever there is work, and sleeps until the next arrival when idle.

Reported per mode: mean/p50/p90/p99 end-to-end latency (finished_time - arrival_time) and time to
first token (first_token_time - arrival_time), and the ratio of mean latencies continuous / static,
whose target is <= 0.43. Same KV budget as the offline benchmark: 8,000 tokens (500 blocks of 16).

    python -m benchmarks.online_latency [--num-requests 64] [--rate-fraction 0.5] [--capacity REQ_PER_S]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from tqdm import tqdm

from benchmarks.workloads import (
    BenchRequest, add_common_args, build_checkpoint, describe_workload, format_table, load_average, make_engine, poisson_arrivals, sampling_params, seed_workload, summarize,
    write_json,
)

MODES = ("continuous", "static")
TARGET_MEAN_RATIO = 0.43  # continuous mean latency / static mean latency must be <= this
PERCENTILES = (50, 90, 99)


@dataclass
class ModeResult:
    mode: str
    latencies_s: list[float]  # end to end, per request in trace order
    ttfts_s: list[float]
    wall_s: float  # from the first arrival to the last completion
    num_steps: int
    num_preemptions: int

    def summary(self) -> dict[str, Any]:
        return {"mode": self.mode, "latency_s": summarize(self.latencies_s, PERCENTILES),
                "ttft_s": summarize(self.ttfts_s, PERCENTILES), "wall_s": self.wall_s,
                "num_steps": self.num_steps, "num_preemptions": self.num_preemptions}


# -- step 1: static capacity ------------------------------------------------------------------------
def measure_static_capacity(model_path: str, requests: Sequence[BenchRequest], args) -> float:
    """Requests/s static batching sustains when everything is queued at once."""
    engine = make_engine(model_path, "static", args)
    t0 = time.perf_counter()
    for i, request in enumerate(requests):
        engine.add_request(str(i), request.prompt_token_ids, sampling_params(request.max_tokens))
    with tqdm(total=len(requests), desc="static capacity", unit="req", file=sys.stderr, leave=False) as bar:
        while engine.has_unfinished_requests():
            bar.update(sum(o.finished for o in engine.step()))
    return len(requests) / (time.perf_counter() - t0)


# -- step 3: real-time replay ---------------------------------------------------------------------------
def replay(model_path: str, mode: str, requests: Sequence[BenchRequest], arrivals: Sequence[float],
           args) -> ModeResult:
    """Feed ``requests`` to a fresh engine at ``arrivals`` (seconds after the start), in real time."""
    engine = make_engine(model_path, mode, args)
    steps_before = engine.num_steps
    finished: dict[str, Any] = {}
    next_up = 0
    t0 = time.time()
    with tqdm(total=len(requests), desc=mode, unit="req", file=sys.stderr, leave=False) as bar:
        while next_up < len(requests) or engine.has_unfinished_requests():
            now = time.time()
            while next_up < len(requests) and t0 + arrivals[next_up] <= now:
                request = requests[next_up]
                engine.add_request(str(next_up), request.prompt_token_ids, sampling_params(request.max_tokens),
                                   arrival_time=t0 + arrivals[next_up])
                next_up += 1
            if engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
            elif next_up < len(requests):
                time.sleep(max(0.0, t0 + arrivals[next_up] - time.time()))
    wall = time.time() - t0
    outputs = [finished[str(i)] for i in range(len(requests))]
    for i, (output, request) in enumerate(zip(outputs, requests)):
        if len(output.outputs[0].token_ids) != request.max_tokens:
            raise RuntimeError(f"{mode}: request {i} got {len(output.outputs[0].token_ids)} tokens, "
                               f"asked for {request.max_tokens}")
    return ModeResult(
        mode,
        [o.metrics.finished_time - o.metrics.arrival_time for o in outputs],
        [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs],
        wall, engine.num_steps - steps_before, engine.stats()["num_preemptions"],
    )


# -- report ---------------------------------------------------------------------------------------------
def print_report(results: dict[str, ModeResult], capacity: float, rate: float, workload: dict,
                 loads: tuple[float | None, float | None], args) -> dict[str, Any]:
    load = ["n/a" if v is None else f"{v:.2f}" for v in loads]
    print(f"\nstatic capacity {capacity:.3f} req/s; Poisson arrivals at {rate:.3f} req/s; "
          f"{workload['num_requests']} requests, {workload['prompt_tokens']} prompt tokens, "
          f"{workload['output_tokens']} output tokens; KV budget {args.kv_budget_tokens} tokens; "
          f"torch threads {torch.get_num_threads()}; load average {load[0]} at start, {load[1]} at end")
    headers = ["mode", "metric", "mean s", *(f"p{p} s" for p in PERCENTILES), "wall s"]
    rows = []
    for mode, r in results.items():
        for metric, values in (("e2e latency", r.latencies_s), ("TTFT", r.ttfts_s)):
            s = summarize(values, PERCENTILES)
            rows.append([mode, metric, s["mean"], *(s[f"p{p}"] for p in PERCENTILES), r.wall_s])
    print(format_table(headers, rows, num_left=2))
    verdict: dict[str, Any] = {}
    if all(m in results for m in MODES):
        value = (summarize(results["continuous"].latencies_s)["mean"]
                 / summarize(results["static"].latencies_s)["mean"])
        verdict = {"ratio": "continuous_mean/static_mean", "value": value, "target": TARGET_MEAN_RATIO,
                   "met": value <= TARGET_MEAN_RATIO}
        print()
        print(format_table(["ratio (e2e latency)", "value", "target", "result"],
                           [[verdict["ratio"], value, f"<= {TARGET_MEAN_RATIO}", "met" if verdict["met"] else
                             "MISSED"]]))
    return verdict


# -- main -----------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.online_latency",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--rate-fraction", type=float, default=0.5,
                        help="arrival rate as a fraction of static mode's offline capacity")
    parser.add_argument("--capacity", type=float,
                        help="static mode's offline capacity in requests/s; None: measure it first")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or set(args.modes) - set(MODES):
        parser.error(f"--modes: choose from {','.join(MODES)}")
    if args.rate_fraction <= 0 or (args.capacity is not None and args.capacity <= 0):
        parser.error("--rate-fraction and --capacity must be > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_path = str(build_checkpoint(args.cache_dir))
    requests = seed_workload(args.num_requests, args.seed, prompt_len_range=args.prompt_lens,
                             output_len_range=args.output_lens)
    load_start = load_average()
    capacity = args.capacity
    if capacity is None:
        print("measuring static capacity ...", file=sys.stderr, flush=True)
        capacity = measure_static_capacity(model_path, requests, args)
        print(f"static capacity: {capacity:.3f} req/s", file=sys.stderr, flush=True)
    rate = capacity * args.rate_fraction
    arrivals = poisson_arrivals(args.num_requests, rate, args.seed)
    results: dict[str, ModeResult] = {}
    for mode in args.modes:
        print(f"replaying the trace ({arrivals[-1]:.1f} s of arrivals) in {mode} mode ...", file=sys.stderr,
              flush=True)
        results[mode] = replay(model_path, mode, requests, arrivals, args)
    workload = describe_workload(requests)
    loads = (load_start, load_average())
    verdict = print_report(results, capacity, rate, workload, loads, args)
    write_json(args.json, {
        "benchmark": "online_latency",
        "config": {**{k: v for k, v in vars(args).items() if k != "json"}, "model": model_path,
                   "kv_budget_tokens": args.kv_budget_tokens, "torch_threads": torch.get_num_threads(),
                   "cpu_count": os.cpu_count(), "load_average_start": loads[0], "load_average_end": loads[1]},
        "capacity_req_per_s": capacity, "capacity_measured": args.capacity is None, "rate_req_per_s": rate,
        "workload": workload, "arrivals_s": arrivals,
        "results": {mode: r.summary() for mode, r in results.items()},
        "latencies_s": {mode: r.latencies_s for mode, r in results.items()},
        "ttfts_s": {mode: r.ttfts_s for mode, r in results.items()},
        "ratio": verdict,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
