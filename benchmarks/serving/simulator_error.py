"""``inflight simulate`` against a served fleet: ``make run``'s server with N replicas under Poisson load (issue 44).

1. The server: ``scripts/serve.sh`` (what ``make run`` runs) on a config of ``--replicas`` replicas of ``--model``,
   each one compute thread, the benchmark's engine arguments (CPU, float32, 500 KV blocks of 16, 64 slots).
2. A profile: the engine alone in this process (one thread, the server idle; ``--profile`` reuses one), then the
   serving path's costs measured on the server (``inflight profile --serving-url``'s: per request and per
   streamed token).
3. The seed workload at ``--rate-fractions`` of the fleet's capacity (the simulator's all-at-once throughput for
   the fleet), Poisson arrivals: streamed through the server (``benchmarks.serving.serving.run_load``), and
   simulated with ``--replicas`` replicas behind the router's least-loaded choice.

Reported per rate: output tokens/s and mean TTFT (bounds: 15%), with mean/p90 end-to-end for context.

    python -m benchmarks.serving.simulator_error --model smollm2-135m-instruct --replicas 2 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import yaml
from tqdm import tqdm

from benchmarks.common.arrivals import arrival_times
from benchmarks.common.engine import engine_args
from benchmarks.common.flags import comma_separated, positive_int
from benchmarks.common.models import add_model_arg, model_from_args
from benchmarks.common.report import describe_machine, load_average, write_json
from benchmarks.common.sim_error import SERVING_BOUNDS, errors, print_comparison, trace_of, within
from benchmarks.common.workloads import build_workload
from benchmarks.peers.serve_vs_vllm import ROOT, stop, wait_ready
from benchmarks.serving.serving import LoadRequest, run_load
from inflight.serve_app.sim.cli import fleet_setup
from inflight.serve_app.sim.fleet import per_request, simulate
from inflight.serve_app.sim.profile import Profile, measure
from inflight.serve_app.sim.report import latency_summary, summarize
from inflight.serve_app.sim.serving_costs import measure_serving

API_PORT = 8000


def serve_config(model: str, served_name: str, replicas: int, engine_kwargs: dict[str, Any]) -> str:
    config = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    app = config["applications"][0]["args"]
    app.update(model=model, served_model_name=served_name, num_replicas=replicas, num_cpus_per_replica=0.5,
               max_queued_requests_per_replica=256, max_pending_requests=1024, default_timeout_s=600,
               routing_policy="least_loaded",
               engine_args={k: v for k, v in engine_kwargs.items() if k not in ("batching",)} | {"max_model_len": 2048})
    return yaml.safe_dump(config, sort_keys=False)


def measured_rows(results) -> list[dict[str, Any]]:
    return [{"ttft_s": r.ttft_s, "e2e_s": r.e2e_s, "output_tokens": r.num_tokens, "tpot_s": r.tpot_s}
            if r.ok else {"unfinished": r.failure} for r in results]


def parse_args(argv: Sequence[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(parser)
    parser.add_argument("--replicas", type=positive_int, default=2)
    parser.add_argument("--num-requests", type=positive_int, default=96)
    parser.add_argument("--rate-fractions", type=comma_separated, default=[0.3, 0.6],
                        help="request rates as fractions of the fleet's simulated capacity")
    parser.add_argument("--profile", help="reuse an engine profile instead of measuring one (the serving path's costs "
                                          "are measured on this server either way)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    args.bench_model = model_from_args(parser, args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model = args.bench_model
    engine_kwargs = engine_args("continuous", threads=1)
    config = Path(tempfile.mkstemp(prefix="simulator-error-", suffix=".yaml")[1])
    config.write_text(serve_config(model.engine_model, model.served_name, args.replicas, engine_kwargs))
    log = open(Path(tempfile.gettempdir()) / "simulator-error-server.log", "w")
    server = subprocess.Popen([str(ROOT / "scripts" / "serve.sh"), str(config)], cwd=ROOT, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    load_start = load_average()
    try:
        wait_ready(API_PORT, server)
        url = f"http://127.0.0.1:{API_PORT}"
        if args.profile:
            profile = Profile.load(args.profile)
        else:
            print("profiling the engine ...", file=sys.stderr, flush=True)
            profile = measure(model.engine_model, {**engine_kwargs, "max_model_len": 2048}, progress=lambda b: tqdm(
                b, desc="profiling", unit="batch", file=sys.stderr))
        print("measuring the server's serving path ...", file=sys.stderr, flush=True)
        profile.serving = measure_serving(url, profile)
        requests = build_workload("seed", args.num_requests, args.seed, model=model)
        setup = fleet_setup(profile, {}, replicas_per_machine=args.replicas)  # all on this machine
        capacity_run = summarize(simulate(trace_of(requests, [0.0] * len(requests)), setup, args.replicas))
        capacity = capacity_run["request_per_s"]
        load = [LoadRequest(r.prompt_token_ids, r.max_tokens) for r in requests]
        runs, each = [], {}  # each: per rate, every request measured and simulated (where errors come from)
        for fraction in args.rate_fractions:
            rate = fraction * capacity
            arrivals = arrival_times(len(requests), rate, seed=args.seed)
            results, duration = asyncio.run(run_load(url, model.served_name, load, arrivals, None,
                                                     {"temperature": 0.0, "ignore_eos": True}, 600.0,
                                                     desc=f"{rate:.2f} req/s"))
            measured_each = measured_rows(results)
            measured = latency_summary(measured_each, duration)
            simulation = simulate(trace_of(requests, arrivals), setup, args.replicas)
            simulated = summarize(simulation)
            label = f"{fraction:.0%} of capacity ({rate:.2f} req/s)"
            runs.append((label, measured, simulated))
            each[label] = [{"arrival_s": a, "prompt_tokens": len(r.prompt_token_ids), "max_tokens": r.max_tokens,
                            "measured": m, "simulated": s}
                           for a, r, m, s in zip(arrivals, requests, measured_each, per_request(simulation))]
    finally:
        stop(server)
        log.close()
    print_comparison(f"inflight simulate vs `make run` with {args.replicas} replicas, {model.name} "
                     f"({profile.describe()}; serving {profile.serving})", runs, SERVING_BOUNDS)
    errors_by_run = {label: errors(m, s) for label, m, s in runs}
    verdict = within(errors_by_run, SERVING_BOUNDS)
    print("within bounds (output tok/s and mean TTFT 15%): "
          + ", ".join(f"{run}: {'yes' if ok else 'NO'}" for run, ok in verdict.items()))
    write_json(args.json, {
        "benchmark": "simulator_error_serving", "model": model.describe(), "replicas": args.replicas,
        "engine_args": engine_kwargs, "capacity_req_per_s": capacity,
        "machine": {**describe_machine(), "load_average_start": load_start, "load_average_end": load_average()},
        "profile": profile.to_json(),
        "runs": [{"run": label, "measured": m, "simulated": s, "error": errors_by_run[label], "requests": each[label]}
                 for label, m, s in runs],
        "within_bounds": verdict, "bounds": SERVING_BOUNDS,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
