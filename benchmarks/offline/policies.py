"""Scheduling policies and KV features, measured: prefix caching on vs off, queue waits under a priority
flood with and without aging, and the admission predictor's error against measured time to first token.

    python -m benchmarks.offline.policies prefix      # shared-prefix workload, cache on vs off
    python -m benchmarks.offline.policies aging       # priority flood: p50/p99 queue wait per class, aging on vs off
    python -m benchmarks.offline.policies predictor   # predicted vs measured TTFT under Poisson arrivals, taken apart
    python -m benchmarks.offline.policies fairness    # tenant A floods, tenant B sends 1/s: B's TTFT, fcfs vs fair
    python -m benchmarks.offline.policies all --json policies.json

All runs use the benchmark checkpoint (``benchmarks.common.workloads``) on the CPU, in one process, side by side.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import numpy as np
from tqdm import tqdm

from benchmarks.common.arrivals import arrival_times
from benchmarks.common.engine import build_engine, drain
from benchmarks.common.metrics import percentile
from benchmarks.common.report import describe_machine, print_table, write_json
from benchmarks.common.workloads import FIRST_WORD_ID, VOCAB_SIZE, build_checkpoint

ENGINE = dict(device="cpu", dtype="float32", block_size=16, num_kv_blocks=1000, max_num_seqs=16,
              max_num_batched_tokens=1024)


def policy_engine(path: str, threads: int | None, **overrides: Any):
    return build_engine(path, **{**ENGINE, "num_threads": threads, **overrides})


def greedy(max_tokens: int, **kwargs: Any):
    from inflight.engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def random_tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(FIRST_WORD_ID, VOCAB_SIZE, size=n).tolist()


# -- prefix caching ----------------------------------------------------------------------------------------
def bench_prefix(path: str, args) -> dict[str, Any]:
    """48 requests sharing a 512-token system prompt plus 32-128 tokens of their own, 32 output tokens each,
    all at once; the same requests with the cache on and off."""
    rng = np.random.default_rng(0)
    system = random_tokens(rng, 512)
    prompts = [system + random_tokens(rng, int(rng.integers(32, 129))) for _ in range(args.num_requests)]
    results = {}
    for enabled in (True, False):
        engine = policy_engine(path, args.threads, enable_prefix_caching=enabled)
        engine.add_request("warm", prompts[0][:40], greedy(2))
        drain(engine)
        computed = 0

        def count(record):
            nonlocal computed
            computed += sum(record.batch.query_lens)

        engine.step_listener = count
        started = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, greedy(32))
        with tqdm(total=len(prompts), desc=f"prefix cache {'on' if enabled else 'off'}", file=sys.stderr,
                  leave=False) as bar:
            while engine.has_unfinished_requests():
                bar.update(sum(o.finished for o in engine.step()))
        seconds = time.perf_counter() - started
        stats = engine.stats()
        hit_rate = stats["prefix_cache_hit_tokens"] / max(1, stats["prefix_cache_query_tokens"])
        results["on" if enabled else "off"] = {
            "seconds": seconds, "output_tokens_per_s": 32 * len(prompts) / seconds,
            "computed_tokens": computed, "hit_rate_tokens": hit_rate}
    results["speedup"] = results["on"]["output_tokens_per_s"] / results["off"]["output_tokens_per_s"]
    print_table("Shared-prefix workload (512-token shared prefix, 48 requests, 32 output tokens each)",
                ["prefix cache", "wall s", "output tok/s", "tokens computed", "hit rate (tokens)"],
                [[name, r["seconds"], r["output_tokens_per_s"], r["computed_tokens"], r["hit_rate_tokens"]]
                 for name, r in ((n, results[n]) for n in ("on", "off"))])
    print(f"cache on / off throughput: x{results['speedup']:.2f}")
    return results


# -- aging under a priority flood -------------------------------------------------------------------------------
def online_run(engine, arrivals: list[tuple[float, str, list[int], Any, int]], desc: str) -> dict[str, dict]:
    """Add each (time, id, prompt, params, priority) at its wall-clock time while stepping; return each request's
    arrival, first-scheduled and first-token times, and its predicted TTFT."""
    done: dict[str, dict] = {}
    start = time.time()
    next_up = 0
    with tqdm(total=len(arrivals), desc=desc, file=sys.stderr, leave=False) as bar:
        while next_up < len(arrivals) or engine.has_unfinished_requests():
            now = time.time() - start
            while next_up < len(arrivals) and arrivals[next_up][0] <= now:
                _, rid, prompt, params, priority = arrivals[next_up]
                engine.add_request(rid, prompt, params, priority=priority)
                next_up += 1
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, arrivals[next_up][0] - now))
                continue
            for output in engine.step():
                if output.finished:
                    m = output.metrics
                    done[output.request_id] = {"arrival": m.arrival_time, "scheduled": m.first_scheduled_time,
                                               "first_token": m.first_token_time, "predicted": m.predicted_ttft_s}
                    bar.update(1)
    return done


def bench_aging(path: str, args) -> dict[str, Any]:
    """A never-ending flood: for ``--seconds`` the engine always has 4 urgent (priority 0) requests waiting
    (each one admitted is replaced at once), 4 slots; background (priority 10) requests arrive at 0.5/s.
    Queue wait (arrival to first scheduled) per class, aging on (``--max-queue-wait-s``) vs off."""
    background_times = arrival_times(max(2, int(args.seconds * 0.5)), 0.5, seed=3)
    results = {}
    for label, max_wait in ((f"aging {args.max_queue_wait_s:g} s", args.max_queue_wait_s), ("no aging", None)):
        rng = np.random.default_rng(1)
        engine = policy_engine(path, args.threads, scheduling_policy="priority", max_queue_wait_s=max_wait,
                               max_num_seqs=4)
        waits: dict[str, list[float]] = {"urgent": [], "background": []}
        names = iter(range(10**9))
        start, next_bg, starved = time.time(), 0, 0

        def add(kind: str, priority: int) -> None:
            prompt = random_tokens(rng, int(rng.integers(50, 200)))
            engine.add_request(f"{kind}-{next(names)}", prompt, greedy(48), priority=priority)

        with tqdm(total=len(background_times), desc=label, file=sys.stderr, leave=False) as bar:
            while time.time() - start < args.seconds or engine.has_unfinished_requests():
                flooding = time.time() - start < args.seconds
                while next_bg < len(background_times) and background_times[next_bg] <= time.time() - start \
                        and flooding:
                    add("background", 10)
                    next_bg += 1
                    bar.update(1)
                urgent_waiting = sum(r.parent_id.startswith("urgent") for r in engine.scheduler.waiting)
                for _ in range(4 - urgent_waiting if flooding else 0):
                    add("urgent", 0)
                for output in engine.step():
                    if output.finished:
                        m = output.metrics
                        waits[output.request_id.split("-")[0]].append(m.first_scheduled_time - m.arrival_time)
            # background requests still queued when the flood ended waited at least this long
            starved = sum(1 for w in waits["background"] if w >= args.seconds / 2)
        results[label] = {cls: {"n": len(w), "p50_s": percentile(w, 50), "p99_s": percentile(w, 99),
                                "max_s": max(w) if w else float("nan")} for cls, w in waits.items()}
        results[label]["background_waiting_over_half_the_flood"] = starved
    print_table(f"Queue wait under a never-ending flood ({args.seconds:.0f} s, always 4 urgent requests waiting, "
                f"4 slots, background at 0.5/s)",
                ["", "urgent p50 s", "urgent p99 s", "background n", "background p50 s", "background p99 s",
                 "background max s"],
                [[label, r["urgent"]["p50_s"], r["urgent"]["p99_s"], r["background"]["n"], r["background"]["p50_s"],
                  r["background"]["p99_s"], r["background"]["max_s"]] for label, r in results.items()])
    return results


# -- fair share between tenants --------------------------------------------------------------------------------
def bench_fairness(path: str, args) -> dict[str, Any]:
    """Tenant A sends ``--flood`` requests at t=0; tenant B one request a second for ``--seconds``. B's time to
    first token: alone, under A's flood with fcfs, and under the flood with the fair policy (virtual token
    counters). The issue's target: under the flood with fair share, B's mean TTFT <= 2x its TTFT alone."""
    rng = np.random.default_rng(4)
    flood = [(0.0, f"a{i}", random_tokens(rng, int(rng.integers(50, 200))), greedy(48, tenant="a"), 0)
             for i in range(args.flood)]
    steady = [(float(i), f"b{i}", random_tokens(rng, int(rng.integers(50, 200))), greedy(48, tenant="b"), 0)
              for i in range(int(args.seconds))]
    results: dict[str, Any] = {}
    for label, policy, arrivals in (("B alone", "fcfs", steady), ("flood, fcfs", "fcfs", flood + steady),
                                    ("flood, fair", "fair", flood + steady)):
        engine = policy_engine(path, args.threads, scheduling_policy=policy, max_queue_wait_s=None)
        done = online_run(engine, sorted(arrivals, key=lambda a: a[0]), label)
        ttft = {rid: d["first_token"] - d["arrival"] for rid, d in done.items()}
        b = [t for rid, t in ttft.items() if rid.startswith("b")]
        a = [t for rid, t in ttft.items() if rid.startswith("a")]
        results[label] = {"b_mean_ttft_s": float(np.mean(b)), "b_p90_ttft_s": percentile(b, 90),
                          "a_mean_ttft_s": float(np.mean(a)) if a else None, "b_n": len(b)}
    alone = results["B alone"]["b_mean_ttft_s"]
    for label in ("flood, fcfs", "flood, fair"):
        results[label]["b_vs_alone"] = results[label]["b_mean_ttft_s"] / alone
    print_table(f"Tenant B's time to first token (1 request/s for {args.seconds:.0f} s) while tenant A floods "
                f"({args.flood} requests at t=0), {ENGINE['max_num_seqs']} slots",
                ["", "B mean TTFT s", "B p90 s", "B vs alone", "A mean TTFT s"],
                [[label, r["b_mean_ttft_s"], r["b_p90_ttft_s"], r.get("b_vs_alone", 1.0), r["a_mean_ttft_s"]]
                 for label, r in results.items()])
    fair = results["flood, fair"]["b_vs_alone"]
    results["met"] = fair <= 2.0
    print(f"fair share: B's mean TTFT under the flood is {fair:.2f}x alone (target <= 2.0: "
          f"{'met' if results['met'] else 'MISSED'}); fcfs: {results['flood, fcfs']['b_vs_alone']:.2f}x")
    return results


# -- the admission predictor --------------------------------------------------------------------------------------
def record_predictions(engine) -> tuple[dict[str, dict], dict[str, Any]]:
    """Wrap this engine's admission check and predictor (the instances, not the classes) to record each
    prediction's terms: the queue it saw, the steps and tokens it counts, the two rates, and the remaining
    output it assumed for the running requests against what they have left (these requests run exactly
    max_tokens tokens). And a step listener: each step's time and prefill tokens, when each request was first
    scheduled and got its first token (step indices), how often a request waited while a slot was free."""
    predictor, scheduler = engine.predictor, engine.scheduler
    made: dict[str, dict] = {}
    steps: dict[str, Any] = {"seconds": {}, "prefill_tokens": {}, "first_scheduled": {}, "first_token": {},
                             "waited_with_free_slot": 0}
    check, predict, admitting = engine.check_deadline, predictor.predict, []

    def checked(requests, *args, **kwargs):
        admitting[:] = [requests[0].parent_id]
        return check(requests, *args, **kwargs)

    def recorded(own, tokens_ahead, num_ahead, remaining, typical=None):
        seconds = predict(own, tokens_ahead, num_ahead, remaining, typical)
        made[admitting[0]] = {
            "step": engine.num_steps, "predicted_s": seconds, "num_ahead": num_ahead, "tokens_ahead": tokens_ahead,
            "own_tokens": own, "num_running": len(remaining), "typical_output": typical,
            "slot_wait_steps": predictor.slot_wait_steps(num_ahead, remaining, typical),
            "prefill_ahead_steps": predictor.prefill_steps(tokens_ahead, len(remaining)),
            "own_steps": predictor.prefill_steps(own, len(remaining)),
            "decode_step_s": predictor.decode_step_s, "per_prefill_token_s": predictor.per_prefill_token_s,
            "remaining_assumed": sum(remaining),
            "remaining_actual": sum(r.params.max_tokens - r.num_output_tokens for r in scheduler.running)}
        return seconds

    def listen(record):
        batch = record.batch
        if batch.is_empty:
            return
        steps["seconds"][record.step_index] = record.duration_s
        steps["prefill_tokens"][record.step_index] = batch.num_tokens - batch.query_lens.count(1)
        for sequence in record.running_ids:
            steps["first_scheduled"].setdefault(record.parent_ids[sequence], record.step_index)
        for sequence, sampled in zip(batch.request_ids, batch.sample):
            if sampled:
                steps["first_token"].setdefault(record.parent_ids[sequence], record.step_index)
        if record.num_waiting and len(record.running_ids) < engine.config.max_num_seqs:
            steps["waited_with_free_slot"] += 1

    engine.check_deadline, predictor.predict, engine.step_listener = checked, recorded, listen
    return made, steps


def explain_predictions(made: dict[str, dict], steps: dict[str, Any], done: dict[str, dict]) -> list[dict]:
    """Per request: the prediction's terms next to what happened. A prediction is (steps) x (seconds per step),
    so predicted / measured = (predicted / actual steps) x (predicted / measured seconds per step): which of the
    two is off."""
    seconds, prefill = steps["seconds"], steps["prefill_tokens"]
    rows = []
    for request_id, p in made.items():
        first_token = steps["first_token"].get(request_id)
        if request_id not in done or first_token is None:
            continue
        window = range(p["step"], first_token + 1)  # the steps from admission to its first token
        actual_steps = len(window)
        measured_s = done[request_id]["first_token"] - done[request_id]["arrival"]
        predicted_steps = max(p["slot_wait_steps"], p["prefill_ahead_steps"]) + p["own_steps"]
        rows.append({**p, "request_id": request_id, "measured_s": measured_s,
                     "predicted_steps": predicted_steps, "actual_steps": actual_steps,
                     "actual_slot_wait_steps": steps["first_scheduled"][request_id] - p["step"],
                     "actual_prefill_tokens": sum(prefill[i] for i in window),
                     "measured_s_per_step": sum(seconds[i] for i in window) / actual_steps,
                     "predicted_s_per_step": p["predicted_s"] / max(1, predicted_steps)})
    return rows


def ratio_quantiles(values: list[float]) -> str:
    if not values:
        return "-"
    p10, p50, p90 = np.percentile(values, [10, 50, 90])
    return f"{p50:.2f} ({p10:.2f}-{p90:.2f})"


def bench_predictor(path: str, args) -> dict[str, Any]:
    """Poisson arrivals of seed-like requests; each request's predicted TTFT (at admission) against its
    measured TTFT (arrival to first token), then the prediction taken apart (``explain_predictions``)."""
    rng = np.random.default_rng(4)
    times = arrival_times(args.num_requests * 2, args.predictor_rate, seed=5)
    arrivals = [(t, str(i), random_tokens(rng, int(rng.integers(50, 800))), greedy(int(rng.integers(20, 200))), 0)
                for i, t in enumerate(times)]
    engine = policy_engine(path, args.threads, max_num_seqs=8, num_kv_blocks=500)
    made, steps = record_predictions(engine)
    done = online_run(engine, arrivals, "predictor")
    rows = explain_predictions(made, steps, done)
    predicted = np.array([r["predicted_s"] for r in rows])
    measured = np.array([r["measured_s"] for r in rows])
    errors, relative = predicted - measured, np.abs(predicted - measured) / measured
    result = {"num_predicted": len(rows), "mean_measured_ttft_s": float(measured.mean()),
              "mean_error_s": float(errors.mean()), "mean_abs_error_s": float(np.abs(errors).mean()),
              "median_abs_relative_error": float(np.median(relative)),
              "p90_abs_relative_error": float(np.percentile(relative, 90)),
              "share_overpredicted": float((errors > 0).mean())}
    print_table(f"Admission TTFT predictor ({args.predictor_rate}/s Poisson, prompts 50-800, outputs 20-200, "
                f"8 slots, 8,000-token KV)",
                ["requests", "mean TTFT s", "mean error s", "mean |error| s", "median |rel. error|",
                 "p90 |rel. error|", "over-predicted"],
                [[result["num_predicted"], result["mean_measured_ttft_s"], result["mean_error_s"],
                  result["mean_abs_error_s"], result["median_abs_relative_error"], result["p90_abs_relative_error"],
                  result["share_overpredicted"]]])
    queued = [r for r in rows if r["slot_wait_steps"] or r["actual_slot_wait_steps"]]
    decode_only = [s for i, s in steps["seconds"].items() if steps["prefill_tokens"][i] == 0]
    terms = [
        ["steps to first token, predicted / actual", ratio_quantiles([r["predicted_steps"] / r["actual_steps"]
                                                                     for r in rows])],
        ["prefill tokens until then, predicted / actual",
         ratio_quantiles([(r["tokens_ahead"] + r["own_tokens"]) / max(1, r["actual_prefill_tokens"]) for r in rows])],
        [f"slot wait in steps, predicted / actual ({len(queued)} requests that waited)",
         ratio_quantiles([r["slot_wait_steps"] / max(1, r["actual_slot_wait_steps"]) for r in queued])],
        ["remaining output of the running requests, assumed / actual",
         ratio_quantiles([r["remaining_assumed"] / r["remaining_actual"] for r in rows if r["remaining_actual"]])],
        ["seconds per step, predicted / measured in its window",
         ratio_quantiles([r["predicted_s_per_step"] / r["measured_s_per_step"] for r in rows])],
        ["decode-only step ms: median, mean, p99 (all steps)",
         f"{1e3 * np.median(decode_only):.1f}, {1e3 * np.mean(decode_only):.1f}, "
         f"{1e3 * np.percentile(decode_only, 99):.1f}" if decode_only else "-"],
        ["steps with requests waiting and a slot free (KV or budget bound)", steps["waited_with_free_slot"]],
        ["preemptions", engine.scheduler.preemption.num_preemptions],
    ]
    print_table("The prediction taken apart: median (p10-p90) over requests", ["term", "value"], terms)
    result["terms"] = {name: value for name, value in terms}
    result["requests"] = rows
    return result


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=("prefix", "aging", "predictor", "fairness", "all"))
    parser.add_argument("--flood", type=int, default=200, help="tenant A's requests at t=0 (fairness)")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of the priority flood")
    parser.add_argument("--max-queue-wait-s", type=float, default=5.0,
                        help="the aging bound for the flood (above the urgent class's own typical wait)")
    parser.add_argument("--predictor-rate", type=float, default=2.0, help="arrivals per second for the predictor run")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    for name in ("num_requests", "seconds", "predictor_rate", "threads", "max_queue_wait_s", "flood"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    path = str(build_checkpoint())
    results: dict[str, Any] = {"machine": describe_machine()}
    runs = {"prefix": bench_prefix, "aging": bench_aging, "predictor": bench_predictor, "fairness": bench_fairness}
    for name, run in runs.items():
        if args.which in (name, "all"):
            results[name] = run(path, args)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
