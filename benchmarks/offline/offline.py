"""Offline throughput: our engine in static and continuous batching, optionally against transformers and vLLM.

Every system runs the same requests on the same model (``--model``, by default the real SmolLM2-135M-Instruct;
``bench-random`` for the random toy Llama; ``benchmarks.common.models``), one after another: our ``LLMEngine`` per
``--batching`` mode, then the ``--baselines`` (transformers' static ``generate`` with padding,
transformers' continuous batching, see ``benchmarks.peers.hf_baselines``, in this process; vLLM's CPU build
in a worker process under its own virtualenv, see ``benchmarks.peers.vllm_baseline``). A named workload has every
request arrive at t=0; a ``--trace`` replays its arrival times (ours only; on the step clock, see
``benchmarks.common.engine_run``). All systems get the same KV budget (default 8 x 1,000 tokens). With
``--repeats`` every system runs that many times, interleaved, and its median run is reported (the
machine may be shared: a burst of other work then hits all systems alike, and the median leaves it out).
``--rate`` has a named workload's requests arrive as a Poisson process instead of all at t=0.

``--workload prefill-only`` compares other systems: ``lane`` and ``mixed``, continuous batching with the
prefill lane on and off, on generation requests with prompt-scoring and embedding requests among them,
and reports what that is about (see ``benchmarks.offline.prefill_only``).

Reported per system: useful output tokens/s (each request's own output length over the time from the
first arrival to the last completion: tokens a static batch computes past a member's end do not count),
padding and wasted tokens, mean/p50/p90/p99 latency (arrival to completion), time in prefill, decode
and mixed steps, mean batch occupancy, mean KV utilisation (block- and token-level); then the
throughput ratios, our mean latency against vLLM's, and a KV diagnosis when token-level utilisation stayed
under 60% while requests waited.

``--workload chat`` is real text through the model's chat template, each request stopping at its end of turn
(useful tokens are then those generated, at most each request's max_tokens; not with transformers' baselines).

    python -m benchmarks.offline.offline --workload seed --batching static,continuous --baselines hf
    python -m benchmarks.offline.offline --workload seed --batching continuous,static --baselines vllm --repeats 3
    python -m benchmarks.offline.offline --model bench-random --workload chat   # no: the toy model has no chat template
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from benchmarks.common.arrivals import arrival_times
from benchmarks.common.engine import add_engine_args, make_engine
from benchmarks.common.engine_run import EngineRun, run_engine
from benchmarks.common.flags import positive_int
from benchmarks.common.metrics import TokenWaste, summarize, useful_computed_tokens
from benchmarks.common.models import add_model_arg, model_from_args
from benchmarks.common.report import describe_machine, load_average, print_table, pyplot, save_figure, write_json
from benchmarks.common.workloads import (
    WORKLOADS, add_workload_args, check_sampling_args, describe_workload, workload_from_args,
)
from benchmarks.offline import prefill_only, speculative, structured
from benchmarks.peers.hf_baselines import BASELINES, BaselineRun, quiet_transformers, run_hf_cb, run_hf_static
from benchmarks.peers.vllm_baseline import MAX_MODEL_LEN, add_vllm_args, describe_settings, run_vllm, settings_from_args

MODES = ("continuous", "static")
BASELINE_CHOICES = {"none": (), "hf": BASELINES, "hf-static": ("hf-static",), "hf-cb": ("hf-cb",), "vllm": ("vllm",)}
# (numerator, denominator, target): the numerator's tokens/s must be >= target x the denominator's (engine issue).
TARGETS = (
    ("continuous", "static", 2.0),
    ("continuous", "hf-static", 2.5),
    ("continuous", "hf-cb", 3.0),
    ("static", "hf-static", 0.8),
    ("continuous", "vllm", 1.1),
)
# (ours, theirs): our mean latency must be <= theirs.
LATENCY_TARGETS = (("continuous", "vllm"),)
# systems that read the model as a Hugging Face directory (a GGUF file's export, benchmarks.common.models)
HF_READERS = {"vllm", "hf-static", "hf-cb", speculative.system_name("draft")}


@dataclass
class SystemResult:
    """One system's run in the numbers every system can report; ``engine_run`` only for ours."""

    system: str
    span_s: float
    useful_tokens: int
    latencies_s: list[float]
    waste: TokenWaste | None
    engine_run: EngineRun | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.span_s

    def summary(self) -> dict[str, Any]:
        if self.engine_run is not None:
            return {"system": self.system, **self.engine_run.summary(), **self.extra}
        waste = self.waste
        return {"system": self.system, "tokens_per_s": self.tokens_per_s, "span_s": self.span_s,
                "useful_tokens": self.useful_tokens, "latency_s": summarize(self.latencies_s),
                "computed_tokens": waste.computed if waste else None,
                "padding_tokens": waste.padding if waste else None,
                "wasted_tokens": waste.wasted if waste else None, **self.extra}


def from_engine_run(system: str, run: EngineRun) -> SystemResult:
    return SystemResult(system, run.span_s, run.useful_tokens, run.latencies_s, run.waste(), run)


def from_baseline_run(run: BaselineRun, requests) -> SystemResult:
    outputs = run.output_tokens if run.output_tokens is not None else [r.max_tokens for r in requests]
    waste = None
    if run.computed_tokens is not None:
        useful = useful_computed_tokens([r.prompt_len for r in requests], outputs)
        waste = TokenWaste(run.computed_tokens, useful, run.computed_tokens - useful)  # all of it is padding
    return SystemResult(run.system, run.span_s, sum(outputs), run.latencies_s, waste, extra=run.extra)


def run_system(system: str, model_path: str, requests, arrivals, args, hf_path: str | None = None) -> SystemResult:
    """``system`` on ``requests``: ours load ``model_path`` (what our engine loads: a packaged model's name, a GGUF
    file, a directory), the peers and a draft model ``hf_path``, the model's Hugging Face directory (a GGUF file's
    export; default ``model_path``)."""
    hf_path = hf_path or model_path
    if system in MODES:
        run = run_engine(make_engine(model_path, system, args), requests, arrivals, desc=system)
        return from_engine_run(system, run)
    if system.startswith("structured-"):
        mixed = structured.with_structured_fraction(requests, structured.fraction_of(system))
        engine = make_engine(model_path, "continuous", args)
        result = from_engine_run(system, run_engine(engine, mixed, arrivals, desc=system))
        result.extra.update(structured.cached_schema_ttft_ms(engine, requests[0].prompt_token_ids))
        return result
    method = speculative.method_of(system)
    if method is not None:
        # a draft model is the checkpoint cut to its first layers: from a Hugging Face directory
        engine = make_engine(model_path, "continuous", args, speculative_config=speculative.speculative_config(
            method, args.oracle_outputs, hf_path))
        result = from_engine_run(system, run_engine(engine, requests, arrivals, desc=system))
        result.extra.update(speculative.summary(engine.stats()))
        return result
    if system in prefill_only.SYSTEMS:
        engine = make_engine(model_path, "continuous", args, prefill_lane=system == "lane")
        started = time.perf_counter()
        run = run_engine(engine, requests, arrivals, desc=system)
        result = from_engine_run(system, run)
        result.extra["wall_s"] = time.perf_counter() - started
        return result
    model = args.bench_model
    if system == "vllm":
        run = run_vllm(hf_path, requests, args.vllm, args.kv_budget_tokens, args.max_num_seqs,
                       args.max_num_batched_tokens, token_range=model.token_range,
                       max_model_len=min(MAX_MODEL_LEN, model.max_position_embeddings))
        return from_baseline_run(run, requests)
    runner = run_hf_static if system == "hf-static" else run_hf_cb
    return from_baseline_run(runner(hf_path, requests, args, model.token_range), requests)


def ratios(results: dict[str, SystemResult]) -> list[dict[str, Any]]:
    rows = []
    for num, den, target in TARGETS:
        if num in results and den in results:
            value = results[num].tokens_per_s / results[den].tokens_per_s
            rows.append({"ratio": f"{num}/{den}", "value": value, "target": target, "met": value >= target})
    return rows


def latency_comparisons(results: dict[str, SystemResult]) -> list[dict[str, Any]]:
    rows = []
    for ours, theirs in LATENCY_TARGETS:
        if ours in results and theirs in results:
            mine, other = (summarize(results[s].latencies_s)["mean"] for s in (ours, theirs))
            rows.append({"ours": ours, "theirs": theirs, "mean_latency_s": mine, "their_mean_latency_s": other,
                         "met": mine <= other})
    return rows


# -- report ---------------------------------------------------------------------------------------------
def print_report(results: dict[str, SystemResult], runs: dict[str, list[SystemResult]],
                 ratio_rows: list[dict[str, Any]], latency_rows: list[dict[str, Any]], workload: dict, name: str,
                 loads: tuple[float | None, float | None], args) -> None:
    load = ["n/a" if v is None else f"{v:.2f}" for v in loads]
    asked = (f"{workload['output_tokens']} useful output tokens" if not workload.get("num_stop_at_eos") else
             f"up to {workload['output_tokens']} output tokens ({workload['num_stop_at_eos']} requests stop at end "
             f"of sequence; generated: " + ", ".join(f"{s} {r.useful_tokens}" for s, r in results.items()) + ")")
    print(f"\nmodel {args.bench_model.name}; workload {name}: {workload['num_requests']} requests, "
          f"{workload['prompt_tokens']} prompt tokens, {asked}; KV budget {args.kv_budget_tokens} tokens; "
          f"torch threads {torch.get_num_threads()}; load average {load[0]} at start, {load[1]} at end")
    rows = []
    for system, r in results.items():
        lat = summarize(r.latencies_s)
        steps = r.engine_run.summary()["steps"] if r.engine_run else {}
        rows.append([system, r.tokens_per_s, r.waste.padding if r.waste else None,
                     r.waste.wasted if r.waste else None, lat["mean"], lat["p50"], lat["p90"], lat["p99"],
                     steps.get("prefill_s"), steps.get("decode_s"), steps.get("mixed_s"),
                     _percent(steps.get("mean_occupancy")), _percent(steps.get("kv_block_utilisation")),
                     _percent(steps.get("kv_token_utilisation")), r.span_s])
    print_table("throughput and latency (latency from arrival to completion, seconds)",
                ["system", "useful tok/s", "padding tok", "wasted tok", "lat mean", "p50", "p90", "p99",
                 "prefill s", "decode s", "mixed s", "occupancy", "KV blocks", "KV tokens", "span s"], rows)
    if "vllm" in results:
        print(describe_settings(results["vllm"].extra))
    if args.repeats > 1:
        print("tokens/s of each repeat: " + "; ".join(
            f"{s} {', '.join(f'{r.tokens_per_s:.0f}' for r in rs)}" for s, rs in runs.items()))
    structured_rows = [(s, r) for s, r in results.items() if s.startswith("structured-")]
    if structured_rows:
        base = results.get(structured.system_name(0.0))
        print_table("structured outputs: a share of the requests under a JSON schema (benchmarks.offline.structured)",
                    ["fraction", "useful tok/s", "vs unconstrained", "TTFT, cached schema - plain (ms)"],
                    [[f"{structured.fraction_of(s):g}", r.tokens_per_s,
                      f"{r.tokens_per_s / base.tokens_per_s:.3f}" if base else "-",
                      f"{r.extra['cached_schema_ttft_ms']:.2f}"] for s, r in structured_rows])
    if any(speculative.method_of(s) for s in results):
        print_table("speculative decoding (benchmarks.offline.speculative): the same tokens, in fewer steps",
                    ["method", "useful tok/s", "vs none", "proposed", "accepted", "acceptance", "verifying steps"],
                    speculative.report_rows(results))
    if ratio_rows:
        print_table("ratios of useful tokens/s (targets from the engine issue)",
                    ["ratio", "value", "target", "result"],
                    [[r["ratio"], r["value"], f">= {r['target']}", "met" if r["met"] else "MISSED"]
                     for r in ratio_rows])
    for r in latency_rows:
        print(f"mean latency: {r['ours']} {r['mean_latency_s']:.2f} s, {r['theirs']} {r['their_mean_latency_s']:.2f} s; "
              f"target {r['ours']} <= {r['theirs']}: {'met' if r['met'] else 'MISSED'}")
    for system, r in results.items():
        diagnosis = r.engine_run.diagnosis() if r.engine_run else None
        if diagnosis:
            print(f"KV diagnosis, {system}: {diagnosis.message}")


def _percent(value: float | None) -> str | None:
    return None if value is None else f"{value:.0%}"


def plot(results: dict[str, SystemResult], name: str, path: str) -> None:
    plt = pyplot()
    fig, (bars, cdf, kv) = plt.subplots(1, 3, figsize=(16, 4.5))
    systems = list(results)
    bars.bar(systems, [results[s].tokens_per_s for s in systems], color=[f"C{i}" for i in range(len(systems))])
    bars.set_ylabel("useful output tokens/s")
    bars.set_title(f"throughput, workload {name}")
    for i, s in enumerate(systems):
        latencies = sorted(results[s].latencies_s)
        cdf.step(latencies, [(k + 1) / len(latencies) for k in range(len(latencies))], where="post", color=f"C{i}",
                 label=s)
        run = results[s].engine_run
        if run is not None:
            clock, util = 0.0, []
            for step in run.steps:
                clock += step.duration_s
                util.append((clock, step.kv_tokens_used / run.limits.kv_tokens_total))
            kv.plot(*zip(*util), color=f"C{i}", label=f"{s}, token-level")
    cdf.set_xlabel("latency, s")
    cdf.set_ylabel("share of requests done")
    cdf.set_title("latency CDF")
    cdf.legend()
    kv.set_xlabel("step clock, s")
    kv.set_ylabel("KV utilisation")
    kv.set_ylim(0, 1.05)
    kv.set_title("KV cache: tokens with KV / token slots")
    kv.legend()
    save_figure(fig, path)


# -- main -----------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, list, list[float] | None, str]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.offline.offline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(parser)
    add_workload_args(parser)
    add_engine_args(parser)
    parser.add_argument("--batching", default="static,continuous",
                        help=f"our batching modes to run, comma-separated subset of {','.join(MODES)} (or none)")
    parser.add_argument("--baselines", default="none",
                        help=f"other systems on the same model, comma-separated subset of "
                             f"{','.join(BASELINE_CHOICES)}: transformers' (hf = both hf-static and hf-cb) and "
                             f"vLLM's CPU build (vllm, in its own virtualenv; see the --vllm-* flags)")
    add_vllm_args(parser)
    parser.add_argument("--repeats", type=positive_int, default=1,
                        help="runs of every system, interleaved; each system's median run is reported")
    parser.add_argument("--rate", type=float, metavar="REQ_PER_S",
                        help="a named workload's requests arrive as a Poisson process at this rate (default: all at 0)")
    parser.add_argument("--structured-fraction", metavar="F[,F...]",
                        help="instead of --batching: continuous runs with these fractions of the requests under a JSON "
                             "schema (benchmarks.offline.structured), e.g. 0,0.2,1.0")
    parser.add_argument("--speculative", metavar="METHOD[,METHOD...]",
                        help=f"instead of --batching: continuous runs with these speculative decoding methods, of "
                             f"{','.join(speculative.METHODS)} (none: without; oracle: proposes a plain run's outputs, "
                             f"computed first), greedy; see benchmarks.offline.speculative")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--plot", metavar="PATH.png", help="also draw throughput, latency CDF and KV utilisation")
    args = parser.parse_args(argv)
    modes = [] if args.batching.strip() == "none" else [m.strip() for m in args.batching.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"--batching: unknown {unknown}; choose from {','.join(MODES)}")
    baselines = parse_baselines(parser, args.baselines)
    args.systems = [m for m in MODES if m in modes] + baselines
    if not args.systems:
        parser.error("--batching none with --baselines none leaves nothing to run")
    if args.speculative:
        methods = [m.strip() for m in args.speculative.split(",") if m.strip()]
        unknown = sorted(set(methods) - set(speculative.METHODS))
        if unknown or not methods:
            parser.error(f"--speculative: unknown {unknown or [args.speculative]}; choose from "
                         f"{','.join(speculative.METHODS)}")
        if baselines or args.structured_fraction:
            parser.error("--speculative compares our engine with itself: no --baselines or --structured-fraction")
        args.systems = [speculative.system_name(m) for m in methods]
    if args.structured_fraction:
        try:
            fractions = [float(f) for f in args.structured_fraction.split(",") if f.strip()]
        except ValueError:
            parser.error(f"--structured-fraction: numbers in [0, 1], got {args.structured_fraction!r}")
        if not fractions or any(not 0.0 <= f <= 1.0 for f in fractions):
            parser.error(f"--structured-fraction: numbers in [0, 1], got {args.structured_fraction!r}")
        if baselines:
            parser.error("--structured-fraction compares our engine with itself; no baseline runs it")
        args.systems = [structured.system_name(f) for f in fractions]
    args.bench_model = model_from_args(parser, args)
    args.dtype = args.bench_model.run_dtype(args.dtype)  # one dtype for every system, "auto" resolved
    requests, arrivals, name = workload_from_args(parser, args, args.bench_model)
    if check_sampling_args(parser, args) and ({"hf-static", "hf-cb"} & set(args.systems) or args.speculative):
        parser.error("--temperature/--top-p: transformers' baselines and --speculative run greedy only")
    if {"hf-static", "hf-cb"} & set(args.systems) and any(not r.ignore_eos for r in requests):
        parser.error(f"--baselines: transformers' baselines run every request to its max_tokens; the {name} workload "
                     f"stops at end of sequence (use --baselines vllm or none)")
    if args.bench_model.kind == "builtin" and set(args.systems) & HF_READERS:
        parser.error(f"--model {args.bench_model.name}: the built-in model has no checkpoint for "
                     f"{', '.join(sorted(set(args.systems) & HF_READERS))}")
    if args.rate is not None:
        if args.trace:
            parser.error("--rate: a --trace brings its own arrival times")
        if not args.rate > 0:
            parser.error(f"--rate must be > 0 requests/s, got {args.rate}")
        arrivals = arrival_times(len(requests), args.rate, seed=args.seed)
    if name == "prefill-only":  # its own comparison: the prefill lane on and off, both continuous
        if baselines:
            parser.error("--baselines: the prefill-only workload compares our prefill lane on and off; "
                         "no baseline runs it")
        args.systems = list(prefill_only.SYSTEMS)
    if arrivals is not None and any(arrivals) and baselines:
        parser.error("--baselines: the baselines take every request at t=0 but --trace or --rate has later arrivals")
    args.vllm = None
    if "vllm" in args.systems:
        try:
            args.vllm = settings_from_args(args)
        except ValueError as e:
            parser.error(str(e))
    return args, requests, arrivals, name


def parse_baselines(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """``--baselines``: a comma-separated list of BASELINE_CHOICES' names as systems, in order, once each."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BASELINE_CHOICES]
    if unknown or not names:
        parser.error(f"--baselines: unknown {unknown or [text]}; choose from {','.join(BASELINE_CHOICES)}")
    if "none" in names and len(names) > 1:
        parser.error(f"--baselines: none with others ({text})")
    systems: list[str] = []
    for name in names:
        systems += [s for s in BASELINE_CHOICES[name] if s not in systems]
    return systems


def main(argv: Sequence[str] | None = None) -> int:
    args, requests, arrivals, name = parse_args(argv)
    torch.set_num_threads(args.threads)
    quiet_transformers()
    model_path = args.bench_model.engine_model
    # the peers and a draft model read a Hugging Face directory: a GGUF file is exported once (benchmarks.common.models)
    hf_path = str(args.bench_model.hf_dir()) if set(args.systems) & HF_READERS else None
    if args.trace is None and WORKLOADS[name].copy_heavy:
        requests = speculative.copy_heavy(requests, model_path, args)
    args.oracle_outputs = (speculative.greedy_outputs(model_path, requests, args)
                           if speculative.system_name("oracle") in args.systems else None)
    runs: dict[str, list[SystemResult]] = {system: [] for system in args.systems}
    load_start = load_average()
    started = time.perf_counter()
    for repeat in range(args.repeats):
        for system in args.systems:  # interleaved: a burst of load elsewhere hits every system alike
            print(f"running {system} ({repeat + 1}/{args.repeats}) ...", file=sys.stderr, flush=True)
            run = run_system(system, model_path, requests, arrivals, args, hf_path)
            runs[system].append(run)
            print(f"{system}: {run.tokens_per_s:.1f} tok/s over {run.span_s:.1f} s", file=sys.stderr, flush=True)
    # the median run of each system by throughput (the lower middle one of an even count)
    results = {s: sorted(r, key=lambda x: x.tokens_per_s)[(len(r) - 1) // 2] for s, r in runs.items()}
    ratio_rows = ratios(results)
    latency_rows = latency_comparisons(results)
    loads = (load_start, load_average())
    workload = describe_workload(requests)
    lane_summaries = ({s: prefill_only.lane_summary(r.engine_run, r.extra.get("wall_s")) for s, r in results.items()}
                      if name == "prefill-only" else None)
    if lane_summaries is not None:
        print(f"\nworkload {name}: {workload['num_requests']} requests ({workload['num_prefill_only']} prefill-only), "
              f"{workload['prompt_tokens']} prompt tokens, {workload['output_tokens']} output tokens; "
              f"arrivals {'Poisson at %g req/s' % args.rate if args.rate else 'all at 0'}; KV budget "
              f"{args.kv_budget_tokens} tokens; torch threads {torch.get_num_threads()}; load average "
              f"{loads[0]} at start, {loads[1]} at end")
        prefill_only.print_lane_report(lane_summaries)
    else:
        print_report(results, runs, ratio_rows, latency_rows, workload, name, loads, args)
    if args.plot:
        plot(results, name, args.plot)
    write_json(args.json, {
        "benchmark": "offline", "workload_name": name, "workload": workload,
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "oracle_outputs", "bench_model")},
        "model": args.bench_model.describe(), "machine": {**describe_machine(), "load_average_start": loads[0],
                                         "load_average_end": loads[1]},
        "elapsed_s": time.perf_counter() - started,
        "results": {s: r.summary() for s, r in results.items()},
        "tokens_per_s_by_repeat": {s: [r.tokens_per_s for r in rs] for s, rs in runs.items()},
        "latencies_s": {s: r.latencies_s for s, r in results.items()},
        "ratios": ratio_rows,
        "mean_latency_targets": latency_rows,
        "prefill_lane": lane_summaries,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
