"""How close ``inflight simulate`` comes to the engine it models: the same traces measured and simulated (issue 44).

1. A profile of the engine on this machine (``inflight profile``'s ``measure``, the benchmark's engine arguments:
   CPU, the 8,000-token KV budget, 64 slots; ``--profile FILE`` reuses one).
2. The seed workload (``--num-requests`` prompts of 50-800 tokens, 20-200 output tokens, greedy, eos ignored) all
   at once, then as a Poisson trace at ``--rate-fraction`` of the capacity the all-at-once run measured.
3. Each trace run for real (a fresh engine, warmed up; requests join at their arrival times on the wall clock,
   the loop sleeping when idle; every time is the wall clock's) ``--repeats`` times, the measured runs
   alternating between the two traces, and through the simulator (one replica, the profile's step costs; it is
   deterministic: once).

Reported per run and per trace over the repeats (each figure's mean, and its spread: the machine's own noise):
output tokens/s, mean TTFT, mean/p90/p99 end-to-end latency, measured and simulated, and the simulator's error;
the acceptance bounds are 10% (tok/s, mean e2e) and 15% (p90 e2e), judged on the mean of the measured runs.

    python -m benchmarks.offline.simulator_error --model smollm2-135m-instruct --json out.json
    python -m benchmarks.offline.simulator_error --model bench-random --json out.json
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from tqdm import tqdm

from benchmarks.common.arrivals import arrival_times
from benchmarks.common.engine import build_engine, engine_args
from benchmarks.common.engine_run import run_engine
from benchmarks.common.flags import positive_float, positive_int
from benchmarks.common.models import add_model_arg, model_from_args
from benchmarks.common.report import describe_machine, load_average, write_json
from benchmarks.common.sim_error import OFFLINE_BOUNDS, errors, mean_of, print_comparison, trace_of, within
from benchmarks.common.workloads import build_workload
from inflight.serve_app.sim.cli import fleet_setup
from inflight.serve_app.sim.fleet import per_request, simulate
from inflight.serve_app.sim.profile import Profile, measure
from inflight.serve_app.sim.report import latency_summary, summarize


def measured_run(engine, requests, arrivals_s: Sequence[float], desc: str) -> dict[str, Any]:
    """``requests`` through ``engine`` at their arrival times on the wall clock; the latency summary."""
    run = run_engine(engine, requests, arrivals_s, desc, wall_clock=True)
    rows = [{"ttft_s": ttft, "e2e_s": e2e, "output_tokens": tokens,
             "tpot_s": (e2e - ttft) / (tokens - 1) if tokens > 1 else None}
            for ttft, e2e, tokens in zip(run.ttfts_s, run.latencies_s, run.output_lens)]
    return latency_summary(rows, run.span_s)


def simulated_run(profile: Profile, requests, arrivals_s: Sequence[float]) -> dict[str, Any]:
    result = simulate(trace_of(requests, arrivals_s), fleet_setup(profile, {}), num_replicas=1)
    assert all("e2e_s" in row for row in per_request(result)), "every simulated request must finish"
    return summarize(result)


def parse_args(argv: Sequence[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(parser)
    parser.add_argument("--profile", help="a profile to use instead of measuring one (same model and engine args)")
    parser.add_argument("--num-requests", type=positive_int, default=64)
    parser.add_argument("--rate-fraction", type=positive_float, default=0.6,
                        help="the Poisson trace's rate as a fraction of the measured all-at-once capacity")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick-profile", action="store_true", help="profile with `inflight profile --quick`")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    args.bench_model = model_from_args(parser, args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.bench_model
    engine_kwargs = engine_args("continuous", threads=args.threads, dtype=args.dtype)
    load_start = load_average()
    if args.profile:
        profile = Profile.load(args.profile)
    else:
        print("profiling the engine ...", file=sys.stderr, flush=True)
        profile = measure(model.engine_model, engine_kwargs, args.quick_profile,
                          lambda batches: tqdm(batches, desc="profiling", unit="batch", file=sys.stderr))
    requests = build_workload("seed", args.num_requests, args.seed, model=model)
    at_once = [0.0] * len(requests)

    def engine():
        return build_engine(model.engine_model, warm_up=model.token_range, **engine_kwargs)

    runs: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    poisson: list[float] | None = None
    rate = None
    simulated_at_once = simulated_run(profile, requests, at_once)
    for repeat in range(args.repeats):
        measured = measured_run(engine(), requests, at_once, f"all at once #{repeat + 1}")
        runs.append((f"all at once #{repeat + 1}", measured, simulated_at_once))
        if poisson is None:  # the rate: a fraction of what the first all-at-once run measured
            rate = args.rate_fraction * len(requests) / measured["duration_s"]
            poisson = arrival_times(len(requests), rate, seed=args.seed)
            simulated_poisson = simulated_run(profile, requests, poisson)
        label = f"Poisson {args.rate_fraction:.0%} #{repeat + 1}"
        runs.append((label, measured_run(engine(), requests, poisson, label), simulated_poisson))
    print_comparison(f"inflight simulate vs measured, {model.name} ({profile.describe()})", runs, OFFLINE_BOUNDS)
    errors_by_run = {label: errors(m, s) for label, m, s in runs}
    traces = {"all at once": simulated_at_once, f"Poisson {args.rate_fraction:.0%}": simulated_poisson}
    means = [(f"{trace}, mean of {args.repeats}", mean_of([m for label, m, _ in runs if label.startswith(trace)]),
              simulated) for trace, simulated in traces.items()]
    print_comparison("... against the mean of the measured runs (spread: (max - min) / mean over the repeats)",
                     means, OFFLINE_BOUNDS)
    print("spread of the measured runs: " + "; ".join(
        f"{label}: " + ", ".join(f"{k.removeprefix('spread_')} {v:.1%}" for k, v in m.items() if k.startswith("spread_"))
        for label, m, _ in means))
    errors_by_run.update({label: errors(m, s) for label, m, s in means})
    verdict = within({label: errors_by_run[label] for label, _, _ in means}, OFFLINE_BOUNDS)
    print(f"within bounds ({', '.join(f'{k} {v:.0%}' for k, v in OFFLINE_BOUNDS.items())}): "
          + ", ".join(f"{run}: {'yes' if ok else 'NO'}" for run, ok in verdict.items()))
    write_json(args.json, {
        "benchmark": "simulator_error", "model": model.describe(), "engine_args": engine_kwargs,
        "machine": {**describe_machine(), "load_average_start": load_start, "load_average_end": load_average()},
        "profile": profile.to_json(), "rate_req_per_s": rate,
        "runs": [{"run": label, "measured": m, "simulated": s, "error": errors_by_run[label]}
                 for label, m, s in runs + means],
        "within_bounds": verdict, "bounds": OFFLINE_BOUNDS,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
