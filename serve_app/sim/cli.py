"""``inflight profile`` and ``inflight simulate``: measure a machine's step costs, then size a fleet on them.

    inflight profile MODEL [engine flags] --out profile.json [--quick] [--serving-url http://127.0.0.1:8000]
    inflight profile --from-gpu-check docs/gpu/gpu_check-2026-12-04.json --out gpu.json
    inflight simulate --profile profile.json --trace trace.jsonl --replicas 2 [engine flags] [--router prefix]
                      [--json out.json] [--plots DIR]
    inflight simulate ... --find-replicas --slo ttft_p99=0.5,tpot_p99=0.05
    inflight simulate ... --sweep rate=1,2,4,8

Engine flags are ``inflight serve``'s (every ``EngineConfig`` field, ``serve_app/cli_args.py``). A simulation
starts from the engine arguments the profile was measured with; flags change what the scheduler does (KV blocks,
``--max-num-seqs``, chunk size, policy, batching mode); flags that change what a step costs (device, dtype,
threads, quantization, tensor parallelism) must match the profile's, which says so.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

from inflight.engine.config import EngineConfig
from inflight.serve_app import cli_args
from inflight.serve_app.sim.fleet import ROUTERS, FleetSetup, per_request, simulate
from inflight.serve_app.sim.profile import Profile
from inflight.serve_app.sim.report import SLO_METRICS, plot_run, plot_sweep, slo_value, summarize, summary_table
from inflight.serve_app.sim.serving_costs import ServingCosts, machine_share
from inflight.serve_app.sim.trace import TraceRequest, at_rate, load_trace, mean_rate

ENGINE_FIELDS = [field for field in cli_args.dataclass_fields(EngineConfig) if field.name != "model"]
# Engine arguments that change what a step costs: a simulation cannot take them other than the profile had them.
COST_ARGS = ("device", "dtype", "quantization", "num_threads", "tensor_parallel_size", "attention_backend",
             "one_thread_max_tokens", "load_format", "enforce_eager", "async_scheduling")
NOT_SIMULATED = ("speculative_config",)


def _progress(total: int, desc: str, quiet: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=quiet, leave=False)


# -- inflight profile ------------------------------------------------------------------------------------------
def profile_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Measure what an engine step costs on this machine "
                                     "(or read a GPU check's), for `inflight simulate`.")
    parser.add_argument("model", nargs="?", help="a packaged model's name, a .gguf file, a checkpoint directory")
    parser.add_argument("--out", type=Path, required=True, help="where to write the profile (JSON)")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter batches (seconds, not minutes)")
    parser.add_argument("--serving-url", help="also measure a running server's costs per request and per streamed "
                                              "token (the server must serve MODEL with the same engine flags)")
    parser.add_argument("--from-gpu-check", type=Path, metavar="FILE",
                        help="no measuring: a profile from benchmarks/micro/gpu_check.sh's JSON")
    cli_args.add_config_flags(parser.add_argument_group("engine arguments (EngineConfig)"), ENGINE_FIELDS)
    return parser


def profile_main(argv: Sequence[str] | None = None, prog: str = "inflight profile") -> int:
    from tqdm import tqdm

    from inflight.serve_app.sim import profile as profiling

    parser = profile_parser(prog)
    args = parser.parse_args(argv)
    engine_args = cli_args.given(args, ENGINE_FIELDS)
    try:
        if args.from_gpu_check is not None:
            if args.model or engine_args or args.serving_url:
                parser.error("--from-gpu-check reads a GPU check's results: give no MODEL, engine flags or --serving-url")
            result = profiling.from_gpu_check(args.from_gpu_check)
        else:
            if not args.model:
                parser.error("give MODEL to measure, or --from-gpu-check FILE")
            EngineConfig.from_kwargs(model=args.model, **engine_args)  # bad flags fail before anything loads
            result = profiling.measure(args.model, engine_args, args.quick,
                                       lambda batches: tqdm(batches, desc="profiling", unit="batch", file=sys.stderr))
            if args.serving_url:
                from inflight.serve_app.sim.serving_costs import measure_serving

                result.serving = measure_serving(args.serving_url, result)
    except ValueError as e:
        parser.error(str(e))
    result.save(args.out)
    error = result.cost_model.fit_error
    print(f"wrote {args.out}: {result.describe()}")
    for term, value in result.cost_model.coefficients.items():
        print(f"  {term:18s} {value:.3e}")
    print("  decode_rows_s      " + ", ".join(f"{rows}: {value:.3e}"
                                              for rows, value in result.cost_model.decode_rows_s.items()))
    if error:
        print(f"  fit: median error {error['median_relative_error']:.1%}, p90 {error['p90_relative_error']:.1%} "
              f"over {error['steps']} steps ({error['dropped_slow_steps']} dropped as slowed by other work)")
    if result.serving != ServingCosts():
        print(f"  serving: {result.serving.request_s * 1e3:.2f} ms a request, {result.serving.message_s * 1e3:.3f} ms "
              f"a streamed token, {result.serving.serving_cores:.2f} of the machine's cores")
    for note in result.notes:
        print(f"  note: {note}")
    return 0


# -- inflight simulate -----------------------------------------------------------------------------------------
def simulate_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Replay a trace through the engine's own scheduler and "
                                     "the router's replica choice across N replicas, on a profile's step costs.")
    parser.add_argument("--profile", type=Path, required=True, help="from `inflight profile`")
    parser.add_argument("--trace", type=Path, required=True, help="JSONL: arrival_s, prompt_tokens, max_tokens, "
                                                                 "optional prefix_id, prefix_tokens, priority, tenant")
    parser.add_argument("--replicas", type=_positive_int, default=1, help="replicas (default 1)")
    parser.add_argument("--replicas-per-machine", type=_positive_int, default=1,
                        help="CPU replicas that share one machine like the profile's: their engines' threads and "
                             "the serving processes' cores are shared out (default 1)")
    parser.add_argument("--router", choices=sorted(ROUTERS), default="least_loaded",
                        help="the router's replica choice (prefix: prefix affinity)")
    parser.add_argument("--routing-stats-period-s", type=float, default=0.5,
                        help="how often each replica reports its load to the router (default 0.5)")
    parser.add_argument("--max-pending-requests", type=_positive_int,
                        help="the router's limit on requests in flight; beyond it 429 (default: none)")
    parser.add_argument("--json", type=Path, help="write the summary and every request's times here")
    parser.add_argument("--plots", type=Path, metavar="DIR", help="draw the latency CDFs, KV use and sweep as PNGs")
    parser.add_argument("--find-replicas", action="store_true", help="the fewest replicas that meet --slo")
    parser.add_argument("--slo", help=f"e.g. ttft_p99=0.5,tpot_p99=0.05 (metrics: {', '.join(SLO_METRICS)})")
    parser.add_argument("--max-replicas", type=_positive_int, default=256, help="--find-replicas' upper bound")
    parser.add_argument("--sweep", help="rate=R1,R2,...: the trace at each request rate (req/s), continuous and "
                                        "static batching")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    cli_args.add_config_flags(parser.add_argument_group("engine arguments (EngineConfig)"), ENGINE_FIELDS)
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def fleet_setup(profile: Profile, overrides: dict[str, Any], routing_stats_period_s: float = 0.5,
                max_pending_requests: int | None = None, replicas_per_machine: int = 1) -> FleetSetup:
    """The engine a simulation runs: the profile's engine arguments with ``overrides`` (engine flags), on machines
    like the profile's (``replicas_per_machine`` to each); ``ValueError`` naming the flag for one that would change
    what a step costs, or one the simulator does not model."""
    for name in NOT_SIMULATED:
        if name in overrides:
            raise ValueError(f"--{name.replace('_', '-')}: not simulated (the simulator has no model outputs)")
    facts = profile.engine
    for name in COST_ARGS:
        if name not in overrides:
            continue
        had = facts.get(name, profile.engine_args.get(name))
        if overrides[name] != had and overrides[name] != profile.engine_args.get(name):
            raise ValueError(f"--{name.replace('_', '-')} {overrides[name]}: the profile was measured with {had!r}, "
                             "and it changes what a step costs; profile again with it")
    share = machine_share(profile)
    if replicas_per_machine > 1 and share is None:
        raise ValueError(f"--replicas-per-machine {replicas_per_machine}: " + (
            f"the profile's engine runs on {profile.engine['device']}, a device each replica has to itself"
            if profile.engine["device"] != "cpu" else "the profile does not say how many cores its machine has"))
    if not routing_stats_period_s > 0:
        raise ValueError(f"--routing-stats-period-s must be > 0, got {routing_stats_period_s}")
    args = {**profile.engine_args, **overrides}
    args.pop("speculative_config", None)
    config = EngineConfig.from_kwargs(model=profile.model, **args)
    if config.num_kv_blocks is not None:
        num_kv_blocks = config.num_kv_blocks
    elif config.kv_cache_memory_bytes is not None:
        num_kv_blocks = config.kv_cache_memory_bytes // facts["kv_bytes_per_block"]
    else:
        num_kv_blocks = facts["num_kv_blocks"]
    if num_kv_blocks < 1:
        raise ValueError("--kv-cache-memory-bytes holds no KV block at the profile's block size")
    wanted = overrides.get("max_model_len")
    max_model_len = wanted if wanted is not None else facts["max_model_len"]
    capacity = num_kv_blocks * config.block_size
    if max_model_len > capacity:
        if wanted is not None:
            raise ValueError(f"--max-model-len {wanted} does not fit {num_kv_blocks} KV blocks of {config.block_size}")
        max_model_len = capacity
    window = tuple(facts["kv_window"]) if facts.get("kv_window") else None
    return FleetSetup(config, num_kv_blocks, max_model_len, profile.cost_model, profile.serving, window,
                      routing_stats_period_s, max_pending_requests, facts["vocab_size"], share,
                      replicas_per_machine)


def parse_slo(text: str) -> dict[str, float]:
    """``ttft_p99=0.5,tpot_p99=0.05`` as {metric: seconds}; ``ValueError`` naming --slo otherwise."""
    slo = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--slo: {part.strip()!r} is not METRIC=SECONDS with METRIC one of {', '.join(SLO_METRICS)}")
        try:
            seconds = float(value)
        except ValueError:
            raise ValueError(f"--slo: {name}={value!r} is not a number of seconds") from None
        if not seconds > 0:
            raise ValueError(f"--slo: {name} must be > 0 seconds, got {seconds}")
        slo[name] = seconds
    return slo


def parse_sweep(text: str) -> list[float]:
    name, sep, values = text.partition("=")
    if name != "rate" or not sep:
        raise ValueError(f"--sweep: expected rate=R1,R2,... (requests per second), got {text!r}")
    try:
        rates = [float(v) for v in values.split(",")]
    except ValueError:
        raise ValueError(f"--sweep: rates must be numbers, got {values!r}") from None
    if not rates or any(not (r > 0 and math.isfinite(r)) for r in rates):
        raise ValueError(f"--sweep: rates must be > 0 requests per second, got {values!r}")
    return sorted(rates)


def meets(summary: dict[str, Any], slo: dict[str, float]) -> bool:
    if summary["num_refused"] or summary["num_unfinished"]:
        return False
    return all(slo_value(summary, metric) <= bound for metric, bound in slo.items())


def run(trace: Sequence[TraceRequest], setup: FleetSetup, replicas: int, router: str, quiet: bool,
        desc: str = "simulating") -> tuple[dict[str, Any], list[dict[str, Any]]]:
    with _progress(len(trace), desc, quiet) as bar:
        result = simulate(trace, setup, replicas, router, progress=bar.update)
    return summarize(result), per_request(result)


def find_replicas(trace: Sequence[TraceRequest], setup: FleetSetup, slo: dict[str, float], router: str,
                  max_replicas: int, quiet: bool) -> tuple[int | None, list[tuple[int, dict[str, Any]]]]:
    """The fewest replicas whose simulation meets ``slo``, and every run tried; None if even ``max_replicas`` does
    not. Doubling, then bisecting: that assumes more replicas never miss an SLO that fewer meet, which routing can
    break by a little at the margin; the answer's one-fewer was always tried and missed it."""
    tried: dict[int, dict[str, Any]] = {}

    def ok(n: int) -> bool:
        if n not in tried:
            tried[n] = run(trace, setup, n, router, quiet, desc=f"{n} replicas")[0]
        return meets(tried[n], slo)

    high = 1
    while not ok(high):
        if high >= max_replicas:
            return None, sorted(tried.items())
        high = min(2 * high, max_replicas)
    low = high // 2  # fails (or 0)
    while high - low > 1:
        middle = (low + high) // 2
        if ok(middle):
            high = middle
        else:
            low = middle
    return high, sorted(tried.items())


def simulate_main(argv: Sequence[str] | None = None, prog: str = "inflight simulate") -> int:
    parser = simulate_parser(prog)
    args = parser.parse_args(argv)
    try:
        profile = Profile.load(args.profile)
        trace = load_trace(args.trace)
        setup = fleet_setup(profile, cli_args.given(args, ENGINE_FIELDS), args.routing_stats_period_s,
                            args.max_pending_requests, args.replicas_per_machine)
        slo = parse_slo(args.slo) if args.slo else None
        if args.find_replicas and not slo:
            raise ValueError("--find-replicas needs --slo, e.g. --slo ttft_p99=0.5,tpot_p99=0.05")
        if slo and not args.find_replicas:
            raise ValueError("--slo is for --find-replicas")
        rates = parse_sweep(args.sweep) if args.sweep else None
        if rates and math.isinf(mean_rate(trace)):
            raise ValueError("--sweep rescales the trace's arrivals: this trace has every request at one time")
        if rates and args.find_replicas:
            raise ValueError("give --sweep or --find-replicas, not both")
    except ValueError as e:
        parser.error(str(e))
    print(f"profile: {profile.describe()}", file=sys.stderr)
    output: dict[str, Any] = {"profile": str(args.profile), "profile_source": profile.describe(),
                              "trace": str(args.trace), "router": args.router, "engine": _engine_summary(setup)}
    if args.find_replicas:
        found, tried = find_replicas(trace, setup, slo, args.router, args.max_replicas, args.quiet)
        print(summary_table([(f"{n} replicas" + (" <- meets the SLO" if n == found else ""), s) for n, s in tried]))
        slo_text = ", ".join(f"{k} <= {v:g} s" for k, v in slo.items())
        if found is None:
            print(f"no fleet of up to {args.max_replicas} replicas meets {slo_text} at this trace's rate")
        else:
            print(f"{found} replica{'s' * (found != 1)} meet{'s' * (found == 1)} {slo_text} at this trace's rate "
                  f"({_rate_text(trace)}), on the profile {profile.describe()}")
        output.update(slo=slo, replicas_needed=found, tried={str(n): s for n, s in tried})
    elif rates:
        base = mean_rate(trace)
        points: dict[str, list[tuple[float, dict[str, Any]]]] = {"continuous": [], "static": []}
        for mode in points:
            mode_setup = fleet_setup(profile, {**cli_args.given(args, ENGINE_FIELDS), "batching": mode},
                                     args.routing_stats_period_s, args.max_pending_requests,
                                     args.replicas_per_machine)
            for rate in rates:
                summary, _ = run(at_rate(trace, rate / base), mode_setup, args.replicas, args.router, args.quiet,
                                 desc=f"{mode} at {rate:g} req/s")
                points[mode].append((rate, summary))
        print(summary_table([(f"{mode} {rate:g} req/s", s) for mode, runs in points.items() for rate, s in runs]))
        crossover = _crossover(points)
        print(crossover["said"])
        output.update(sweep={mode: [{"rate": r, **s} for r, s in runs] for mode, runs in points.items()},
                      crossover=crossover)
        if args.plots:
            print(f"wrote {plot_sweep(points, args.plots, Path(args.trace).name)}")
    else:
        summary, rows = run(trace, setup, args.replicas, args.router, args.quiet)
        print(summary_table([(f"{args.replicas} x {Path(args.trace).name}", summary)]))
        output.update(replicas=args.replicas, summary=summary, requests=rows)
        if args.plots:
            for path in plot_run(rows, summary, args.plots, Path(args.trace).name):
                print(f"wrote {path}")
    if args.json:
        args.json.write_text(json.dumps(_finite(output), indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def _crossover(points: dict[str, list[tuple[float, dict[str, Any]]]]) -> dict[str, Any]:
    """Where continuous batching starts to beat static by mean latency, as the rate grows."""
    ratios = [(rate, c["mean_e2e_s"] / s["mean_e2e_s"])
              for (rate, c), (_, s) in zip(points["continuous"], points["static"])]
    winning = [rate for rate, ratio in ratios if ratio < 1.0]
    if len(winning) == len(ratios):
        said = "continuous batching has the lower mean latency at every rate swept"
        rate = None
    elif not winning:
        said = "static batching has the lower (or equal) mean latency at every rate swept"
        rate = None
    else:
        rate = min(winning)
        said = f"continuous batching's mean latency drops below static's from {rate:g} req/s"
    return {"rate": rate, "continuous_over_static_mean_e2e": ratios, "said": said}


def _rate_text(trace: Sequence[TraceRequest]) -> str:
    rate = mean_rate(trace)
    return f"{len(trace)} requests at once" if math.isinf(rate) else f"{rate:.2f} req/s"


def _engine_summary(setup: FleetSetup) -> dict[str, Any]:
    config = setup.config
    return {"batching": config.batching, "num_kv_blocks": setup.num_kv_blocks, "block_size": config.block_size,
            "max_num_seqs": config.max_num_seqs, "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_model_len": setup.max_model_len, "scheduling_policy": config.scheduling_policy,
            "enable_prefix_caching": config.enable_prefix_caching, "serving": vars(setup.serving),
            "replicas_per_machine": setup.replicas_per_machine,
            "machine": vars(setup.machine) if setup.machine is not None else None}


def _finite(value: Any) -> Any:
    """``value`` with NaN and infinities as null: strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
