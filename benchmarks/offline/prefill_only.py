"""The prefill lane against mixed batching, on the ``prefill-only`` workload.

``python -m benchmarks.offline.offline --workload prefill-only`` runs two systems on the same requests, one after
the other in one process: ``lane`` (continuous batching, ``prefill_lane=True``: scoring and embedding
requests go through the lane, static batches without the KV cache) and ``mixed`` (``prefill_lane=False``:
they go through the continuous scheduler and the paged cache like any prefill). Same model, KV budget,
slots and token budget. The workload is the seed's mix with every other request replaced by prompt
scoring (``max_tokens=0, prompt_logprobs=1``) or an embedding, in turn; with ``--rate`` they arrive as a
Poisson process, else all at t=0.

Reported per system (seconds on the step clock, see ``benchmarks.common.engine_run``): prefill-only latency
(arrival to done) p50/p99, the generation requests' TTFT p50/p99 and TPOT p50, their output tokens/s
(over the span from the first arrival to the last generation request's end), the whole span, and the
wall time of the run.
"""

from __future__ import annotations

from typing import Any

from benchmarks.common.engine_run import EngineRun
from benchmarks.common.metrics import summarize, time_per_output_token
from benchmarks.common.report import print_table

SYSTEMS = ("lane", "mixed")  # prefill_lane on / off


def lane_summary(run: EngineRun, wall_s: float | None = None) -> dict[str, Any]:
    """The numbers this comparison is about, from one run of the workload."""
    kinds = [r.kind for r in run.requests]
    generate = [i for i, kind in enumerate(kinds) if kind == "generate"]
    prefill_only = [i for i, kind in enumerate(kinds) if kind != "generate"]
    latencies, ttfts = run.latencies_s, run.ttfts_s
    tpots = [time_per_output_token(ttfts[i], latencies[i], run.requests[i].max_tokens) for i in generate]
    generation_span = max((run.finished_s[i] for i in generate), default=0.0) - min(run.arrivals_s)
    generated = sum(run.requests[i].max_tokens for i in generate)
    return {
        "num_generate": len(generate), "num_prefill_only": len(prefill_only),
        "prefill_only_latency_s": summarize([latencies[i] for i in prefill_only]),
        "generate_ttft_s": summarize([ttfts[i] for i in generate]),
        "generate_tpot_s": summarize([t for t in tpots if t is not None]),
        "generate_tokens_per_s": generated / generation_span if generation_span > 0 else None,
        "span_s": run.span_s, "wall_s": wall_s, "num_preemptions": run.num_preemptions,
    }


def print_lane_report(summaries: dict[str, dict[str, Any]]) -> None:
    rows = []
    for system, s in summaries.items():
        latency, ttft, tpot = s["prefill_only_latency_s"], s["generate_ttft_s"], s["generate_tpot_s"]
        rows.append([system, latency["p50"], latency["p99"], ttft["p50"], ttft["p99"], tpot["p50"] * 1000,
                     s["generate_tokens_per_s"], s["span_s"], s["wall_s"], s["num_preemptions"]])
    first = next(iter(summaries.values()))
    print_table(f"prefill lane vs mixed: {first['num_prefill_only']} prefill-only requests (scoring, embeddings) "
                f"among {first['num_generate']} generation requests (seconds on the step clock)",
                ["system", "prefill-only p50", "p99", "gen TTFT p50", "p99", "gen TPOT p50 ms", "gen tok/s",
                 "span s", "wall s", "preemptions"], rows)
    if set(SYSTEMS) <= set(summaries):
        lane, mixed = summaries["lane"], summaries["mixed"]
        print("lane / mixed: prefill-only p50 x{:.2f}, p99 x{:.2f}; generation TTFT p50 x{:.2f}, TPOT p50 x{:.2f}, "
              "tok/s x{:.2f}".format(
                  lane["prefill_only_latency_s"]["p50"] / mixed["prefill_only_latency_s"]["p50"],
                  lane["prefill_only_latency_s"]["p99"] / mixed["prefill_only_latency_s"]["p99"],
                  lane["generate_ttft_s"]["p50"] / mixed["generate_ttft_s"]["p50"],
                  lane["generate_tpot_s"]["p50"] / mixed["generate_tpot_s"]["p50"],
                  lane["generate_tokens_per_s"] / mixed["generate_tokens_per_s"]))
