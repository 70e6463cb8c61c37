"""How fast ``inflight simulate`` runs: a ``--num-requests`` Poisson trace of the seed workload's lengths (prompts of
50-800 tokens, 20-200 output tokens) across ``--replicas`` replicas, on a profile (``--profile``; by default one
of made-up costs near the real model's on this CPU, since only the simulator's own speed is measured here), at
``--load`` of the fleet's simulated capacity. Reports the wall time, the simulated span and their ratio, steps
simulated per second. The target (issue 44): 10,000 requests on 8 replicas in under a minute. ``--write-trace``
keeps the trace for ``inflight simulate``.

    python -m benchmarks.micro.simulator_speed --num-requests 10000 --replicas 8 --json out.json
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Sequence

import numpy as np

from benchmarks.common.arrivals import arrival_times
from benchmarks.common.flags import positive_float, positive_int
from benchmarks.common.report import describe_machine, print_table, write_json
from inflight.engine.config import EngineConfig
from inflight.serve_app.sim.cli import fleet_setup
from inflight.serve_app.sim.cost_model import StepCostModel
from inflight.serve_app.sim.fleet import FleetSetup, simulate
from inflight.serve_app.sim.profile import Profile
from inflight.serve_app.sim.report import summarize
from inflight.serve_app.sim.trace import TraceRequest, write_trace

TARGET_S = 60.0  # 10,000 requests on 8 replicas
# near SmolLM2-135M's float32 steps on this CPU, one thread: only the simulator's speed is measured
MADE_UP = StepCostModel({"step_s": 0.012, "prefill_token_s": 2.5e-4, "prefill_row_s": 5e-4, "prefill_pair_s": 1e-8,
                         "decode_row_s": 1e-3, "decode_context_s": 2e-7, "sampled_row_s": 1e-4, "rebuilt_row_s": 5e-5})


def seed_lengths(num: int, seed: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    return list(zip(rng.integers(50, 801, size=num).tolist(), rng.integers(20, 201, size=num).tolist()))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=positive_int, default=10_000)
    parser.add_argument("--replicas", type=positive_int, default=8)
    parser.add_argument("--load", type=positive_float, default=0.6, help="the rate as a fraction of capacity")
    parser.add_argument("--profile", help="a profile (default: made-up costs near the real model's here)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json")
    parser.add_argument("--write-trace", metavar="PATH", help="also write the trace (JSONL), for `inflight simulate`")
    args = parser.parse_args(argv)
    if args.profile:
        setup = fleet_setup(Profile.load(args.profile), {})
    else:
        config = EngineConfig.from_kwargs(model="made-up", num_kv_blocks=500, max_num_seqs=64)
        setup = FleetSetup(config, 500, 2048, MADE_UP)
    lengths = seed_lengths(args.num_requests, args.seed)
    burst = [TraceRequest(p, o) for p, o in lengths[:256]]  # capacity: a burst through one replica
    capacity = summarize(simulate(burst, setup, 1))["request_per_s"] * args.replicas
    rate = args.load * capacity
    arrivals = arrival_times(args.num_requests, rate, seed=args.seed)
    trace = [TraceRequest(p, o, a) for (p, o), a in zip(lengths, arrivals)]
    if args.write_trace:
        write_trace(args.write_trace, trace)
    started = time.perf_counter()
    result = simulate(trace, setup, args.replicas)
    wall = time.perf_counter() - started
    summary = summarize(result)
    rows = [[args.num_requests, args.replicas, rate, summary["steps"], summary["duration_s"], wall,
             summary["duration_s"] / wall, summary["steps"] / wall, "yes" if wall < TARGET_S else "NO"]]
    print_table("inflight simulate's own speed", ["requests", "replicas", "req/s", "steps", "simulated s", "wall s",
                                                  "x real time", "steps/s", f"under {TARGET_S:.0f} s"], rows)
    write_json(args.json, {"benchmark": "simulator_speed", "machine": describe_machine(), "config": vars(args),
                           "rate_req_per_s": rate, "wall_s": wall, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
