"""Load test for any OpenAI-compatible endpoint (ours, vLLM, ...): streaming latency, throughput, goodput.

Requests (a named workload's lengths with prompts of random token ids from the model's ordinary tokens, the
``chat`` workload's conversations through the model's chat template that stop at its end of turn, or a JSONL
trace) are sent to ``POST /v1/completions`` with ``stream=true``, at each of ``--rates`` requests/s with gamma
gaps (``--burstiness`` 1 is Poisson; below 1 burstier; ``inf`` sends all at once), or at a trace's
``arrival_s``; ``--max-concurrency`` caps the requests in flight (a request's clock starts when it is sent).

Per rate: TTFT (first content chunk), TPOT ((e2e - TTFT) / (tokens - 1)), ITL (gaps between content
chunks: a server that batches messages sends several tokens per chunk) and end-to-end latency as
mean/p50/p90/p99; output tokens/s and requests/s from the first send to the last completion; goodput,
the requests/s that succeeded within the ``--slo-*`` limits; and failures by HTTP status, 429 apart.

``--model`` names the model to ask for: a model the benchmarks know (``benchmarks.common.models``: smollm2-135m-instruct,
bench-random, demo-tiny, a .gguf file or a checkpoint directory) is asked for by its served name (what our server
and ``vllm serve`` call it by default: the name, or the path), and its tokenizer gives the prompts' token ids and
the chat workload's texts; any other name is asked for as it is, with prompts of ids in ``--vocab-range``. Without
``--model``, the first model ``/v1/models`` lists (under ``make run``, the real model). ``--served-model-name``
asks for another name than that.

The client shares the machine with the server when both run locally: its own CPU time is in the numbers.

    python -m benchmarks.serving.serving --base-url http://127.0.0.1:8000 --rates 2,4,8 --slo-ttft-ms 500 --slo-tpot-ms 50
    python -m benchmarks.serving.serving --model smollm2-135m-instruct --workload chat --rates 1 --num-requests 8
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import aiohttp
import numpy as np
from tqdm import tqdm

from benchmarks.common.arrivals import arrival_times, load_trace
from benchmarks.common.flags import comma_separated, positive_int
from benchmarks.common.metrics import SLO, RequestLatency, goodput, inter_token_latencies, summarize, time_per_output_token
from benchmarks.common.models import BenchModel, resolve_model
from benchmarks.common.openai_client import CLIENT_ERRORS, client_session, stream_completion
from benchmarks.common.report import load_average, print_table, pyplot, save_figure, write_json
from benchmarks.common.workloads import WORKLOADS, build_workload

DEMO_TINY_VOCAB = (7, 263)  # demo-tiny's byte ids: prompts for a model the benchmarks do not know


@dataclass(frozen=True)
class LoadRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    ignore_eos: bool = True  # False: it stops at the model's end of sequence (the chat workload), whatever --ignore-eos


@dataclass
class RequestResult:
    status: int | None  # HTTP status; None when no response came (connection refused, reset, timeout)
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    num_tokens: int = 0
    chunk_times_s: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None:
            return None
        return time_per_output_token(self.ttft_s, self.e2e_s, self.num_tokens)

    @property
    def failure(self) -> str | None:
        """How it failed, for counting: the HTTP status, or what went wrong without one."""
        if self.ok:
            return None
        if self.status is None:
            return "no response"
        return str(self.status) if self.status != 200 else "error in stream"


# -- sending ---------------------------------------------------------------------------------------------
async def send_one(session: aiohttp.ClientSession, base_url: str, model: str, request: LoadRequest,
                   extra: dict[str, Any]) -> RequestResult:
    if not request.ignore_eos:
        extra = {k: v for k, v in extra.items() if k != "ignore_eos"}
    try:
        result = await stream_completion(session, base_url, model, request.prompt_token_ids, request.max_tokens,
                                         **extra)
    except CLIENT_ERRORS as e:
        return RequestResult(None, error=f"{type(e).__name__}: {e}")
    return RequestResult(result.status, result.error, result.ttft_s, result.e2e_s, result.num_tokens,
                         result.chunk_times_s)


async def run_load(base_url: str, model: str, requests: Sequence[LoadRequest], arrivals_s: Sequence[float],
                   max_concurrency: int | None, extra: dict[str, Any], timeout_s: float,
                   desc: str) -> tuple[list[RequestResult], float]:
    """Send each request at its arrival time (or later, when ``max_concurrency`` are in flight); returns the
    results in request order and the seconds from the first send to the last completion."""
    limit = max_concurrency or len(requests)
    gate = asyncio.Semaphore(limit)
    async with client_session(limit, timeout_s) as session:
        bar = tqdm(total=len(requests), desc=desc, unit="req", file=sys.stderr, leave=False)
        start = time.perf_counter()

        async def one(request: LoadRequest, arrival_s: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + arrival_s - time.perf_counter()))
            async with gate:
                result = await send_one(session, base_url, model, request, extra)
            bar.update(1)
            return result

        results = await asyncio.gather(*(one(r, a) for r, a in zip(requests, arrivals_s)))
        duration = time.perf_counter() - start
        bar.close()
    return list(results), duration


async def first_model(base_url: str, timeout_s: float) -> str:
    async with client_session(1, timeout_s) as session:
        async with session.get(f"{base_url}/v1/models") as response:
            response.raise_for_status()
            models = (await response.json()).get("data") or []
    if not models:
        raise ValueError(f"--model: {base_url}/v1/models lists no model; name one")
    return models[0]["id"]


# -- numbers ---------------------------------------------------------------------------------------------
def summarize_load(results: Sequence[RequestResult], duration_s: float, slo: SLO) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    failures = Counter(r.failure for r in results if not r.ok)
    per_s, share = goodput([RequestLatency(r.ok, r.ttft_s, r.tpot_s, r.e2e_s) for r in results], slo, duration_s)
    itls = [gap for r in ok for gap in inter_token_latencies(r.chunk_times_s)]
    return {
        "num_requests": len(results), "num_ok": len(ok), "failures": dict(failures),
        "num_429": failures.get("429", 0), "duration_s": duration_s,
        "requests_per_s": len(ok) / duration_s, "output_tokens_per_s": sum(r.num_tokens for r in ok) / duration_s,
        "ttft_s": summarize(r.ttft_s for r in ok if r.ttft_s is not None),
        "tpot_s": summarize(t for r in ok if (t := r.tpot_s) is not None),
        "itl_s": summarize(itls),
        "e2e_s": summarize(r.e2e_s for r in ok),
        "goodput_requests_per_s": per_s, "goodput_share": share,
    }


# -- report ---------------------------------------------------------------------------------------------
def print_report(summaries: dict[str, dict[str, Any]], slo: SLO) -> None:
    def ms(value: float) -> float:
        return value * 1e3

    rows = []
    for rate, s in summaries.items():
        rows.append([rate, *(ms(s[m][p]) for m in ("ttft_s", "tpot_s", "itl_s", "e2e_s") for p in ("mean", "p50",
                                                                                                     "p90", "p99"))])
    headers = ["rate req/s"] + [f"{m} {p}" for m in ("TTFT", "TPOT", "ITL", "e2e") for p in ("mean", "p50", "p90",
                                                                                            "p99")]
    print_table("latency of successful requests, milliseconds", headers, rows)
    slo_text = ", ".join(f"{name} <= {limit * 1e3:g} ms" for name, limit in
                         (("TTFT", slo.ttft_s), ("TPOT", slo.tpot_s), ("e2e", slo.e2e_s)) if limit is not None)
    rows = []
    for rate, s in summaries.items():
        other = {k: v for k, v in s["failures"].items() if k != "429"}
        rows.append([rate, s["num_ok"], s["num_requests"] - s["num_ok"], s["num_429"],
                     ", ".join(f"{k}: {v}" for k, v in sorted(other.items())) or "", s["requests_per_s"],
                     s["output_tokens_per_s"], s["goodput_requests_per_s"], f"{s['goodput_share']:.0%}",
                     s["duration_s"]])
    print_table(f"throughput and goodput ({slo_text or 'no SLO given: goodput = successful requests'})",
                ["rate req/s", "ok", "failed", "429", "other failures", "req/s", "output tok/s", "goodput req/s",
                 "good share", "duration s"], rows)


def _load(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def plot(summaries: dict[str, dict[str, Any]], path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    x = [s["output_tokens_per_s"] for s in summaries.values()]
    for ax, metric, title in zip(axes[:2], ("ttft_s", "tpot_s"), ("TTFT", "TPOT")):
        for p, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            ax.plot(x, [s[metric][p] * 1e3 for s in summaries.values()], style, label=p)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{title}, ms")
        ax.set_title(f"{title} by throughput")
        ax.legend()
    rates = list(summaries)
    axes[2].bar(rates, [s["requests_per_s"] for s in summaries.values()], color="#bbbbbb", label="completed")
    axes[2].bar(rates, [s["goodput_requests_per_s"] for s in summaries.values()], color="C2", label="within SLO")
    axes[2].set_xlabel("offered rate, req/s")
    axes[2].set_ylabel("requests/s")
    axes[2].set_title("goodput")
    axes[2].legend()
    save_figure(fig, path)


# -- main -----------------------------------------------------------------------------------------------
def parse_rates(text: str) -> list[float]:
    rates = comma_separated(text, float, "numbers (or inf)")
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be > 0 requests/s, got {text!r}")
    return rates


def milliseconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 ms, got {text}")
    return value / 1e3


def make_requests(lengths: Sequence[tuple[int, int]], vocab_range: Sequence[int], seed: int) -> list[LoadRequest]:
    rng = np.random.default_rng(seed)
    return [LoadRequest(rng.integers(vocab_range[0], vocab_range[1], size=p).tolist(), o) for p, o in lengths]


def known_model(name: str | None) -> BenchModel | None:
    """``name`` as a model the benchmarks know, or None (any other served name)."""
    if name is None:
        return None
    try:
        return resolve_model(name)
    except ValueError:
        return None


def build_requests(args, model: BenchModel | None) -> list[LoadRequest]:
    """The requests for ``args``' workload (or trace): token ids from ``--vocab-range``, else ``model``'s ordinary
    tokens, else demo-tiny's; the chat workload's conversations through ``model``'s chat template."""
    if not args.trace and WORKLOADS[args.workload].chat:
        if model is None:
            raise ValueError(f"--workload chat: the model {args.served_model_name or args.model!r} is not one the "
                             f"benchmarks know, so its chat template is unknown: give --model (a name or a path)")
        return [LoadRequest(r.prompt_token_ids, r.max_tokens, r.ignore_eos) for r in
                build_workload(args.workload, args.num_requests, args.seed, args.prompt_lens, args.output_lens, model)]
    vocab = args.vocab_range or (model.token_range if model is not None else DEMO_TINY_VOCAB)
    return make_requests(args.lengths, vocab, args.seed)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving.serving", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    parser.add_argument("--model", metavar="NAME|PATH",
                        help="the model: one the benchmarks know (smollm2-135m-instruct, bench-random, demo-tiny, a "
                             ".gguf file, a checkpoint directory: asked for by its served name, prompts from its "
                             "tokenizer) or any served name; default: the first one /v1/models lists")
    parser.add_argument("--served-model-name", metavar="NAME",
                        help="the name to ask the server for, if not --model's served name")
    parser.add_argument("--rates", type=parse_rates, default=parse_rates("2,4,8"),
                        help="requests/s, comma-separated, one run each; inf sends everything at once")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the gaps between arrivals: 1 is Poisson, below 1 burstier")
    parser.add_argument("--max-concurrency", type=positive_int, help="at most this many requests in flight")
    parser.add_argument("--workload", default="seed", choices=list(WORKLOADS), metavar="NAME",
                        help=f"request lengths, one of: {', '.join(WORKLOADS)}")
    parser.add_argument("--trace", metavar="FILE.jsonl",
                        help="send a trace of {prompt_tokens, output_tokens, arrival_s} lines instead (--rates unused)")
    parser.add_argument("--num-requests", type=positive_int, default=64, help="requests per rate")
    parser.add_argument("--prompt-lens", type=positive_int, nargs=2, metavar=("MIN", "MAX"),
                        help="prompt length range in tokens (default: the workload's)")
    parser.add_argument("--output-lens", type=positive_int, nargs=2, metavar=("MIN", "MAX"),
                        help="output length range in tokens (default: the workload's)")
    parser.add_argument("--vocab-range", type=int, nargs=2, metavar=("LOW", "HIGH"),
                        help="prompt token ids are drawn from [LOW, HIGH) (default: the model's ordinary tokens, for a "
                             f"model the benchmarks know; else demo-tiny's, {DEMO_TINY_VOCAB[0]} {DEMO_TINY_VOCAB[1]})")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="ask for exactly max_tokens tokens (vLLM's extension; ours has it); the chat workload's "
                             "requests stop at end of turn whatever this says")
    parser.add_argument("--slo-ttft-ms", type=milliseconds, help="goodput: time to first token at most this")
    parser.add_argument("--slo-tpot-ms", type=milliseconds, help="goodput: time per output token at most this")
    parser.add_argument("--slo-e2e-ms", type=milliseconds, help="goodput: end-to-end latency at most this")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per-request HTTP timeout")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times")
    parser.add_argument("--json", metavar="PATH", help="also write the results (and every request) as JSON here")
    parser.add_argument("--plot", metavar="PATH.png", help="also draw latency percentiles and goodput by rate")
    args = parser.parse_args(argv)
    if not args.burstiness > 0:
        parser.error(f"--burstiness must be > 0, got {args.burstiness}")
    if args.vocab_range is not None:
        low, high = args.vocab_range
        if not 0 <= low < high:
            parser.error(f"--vocab-range: need 0 <= LOW < HIGH, got {low} {high}")
    if args.model is not None and (args.model.endswith(".gguf") or os.sep in args.model):
        try:  # a path that is not a model is a mistake, not a served name
            resolve_model(args.model)
        except ValueError as e:
            parser.error(str(e))
    for flag in ("prompt_lens", "output_lens"):
        value = getattr(args, flag)
        if value is not None and value[0] > value[1]:
            parser.error(f"--{flag.replace('_', '-')}: MIN ({value[0]}) is larger than MAX ({value[1]})")
    args.base_url = args.base_url.rstrip("/")
    try:
        if args.trace:
            entries = load_trace(args.trace)
            args.lengths = [(e.prompt_tokens, e.output_tokens) for e in entries]
            args.trace_arrivals = [e.arrival_s for e in entries]
        elif not WORKLOADS[args.workload].chat:  # (chat: its lengths come with its texts, from the model)
            workload = build_workload(args.workload, args.num_requests, args.seed, args.prompt_lens, args.output_lens)
            args.lengths = [(r.prompt_len, r.max_tokens) for r in workload]
    except ValueError as e:
        parser.error(str(e))
    args.slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        name = args.model or args.served_model_name or asyncio.run(first_model(args.base_url, args.timeout_s))
    except CLIENT_ERRORS as e:
        print(f"error: --base-url {args.base_url}: cannot list models ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    known = known_model(name)
    model = args.served_model_name or (known.served_name if known else name)
    try:
        requests = build_requests(args, known)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    extra = {"temperature": 0.0, **({"ignore_eos": True} if args.ignore_eos else {})}
    runs: dict[str, tuple[list[float], list[RequestResult], float]] = {}
    load_start = load_average()
    schedules = ({"trace": args.trace_arrivals} if args.trace else
                 {f"{rate:g}": arrival_times(len(requests), rate, args.burstiness, args.seed) for rate in args.rates})
    for name, arrivals in schedules.items():
        print(f"{model} at {args.base_url}: rate {name} ...", file=sys.stderr, flush=True)
        results, duration = asyncio.run(run_load(args.base_url, model, requests, arrivals, args.max_concurrency,
                                                 extra, args.timeout_s, desc=f"rate {name}"))
        runs[name] = (arrivals, results, duration)
    summaries = {name: summarize_load(results, duration, args.slo) for name, (_, results, duration) in runs.items()}
    print(f"\n{model} at {args.base_url}; workload {'trace' if args.trace else args.workload}; {len(requests)} "
          f"requests per rate, burstiness {args.burstiness:g}, max "
          f"concurrency {args.max_concurrency or 'none'}; load average {_load(load_start)} at start, "
          f"{_load(load_average())} at end")
    print_report(summaries, args.slo)
    if args.plot:
        plot(summaries, args.plot)
    write_json(args.json, {
        "benchmark": "serving", "model": model, "bench_model": known.describe() if known else None,
        "base_url": args.base_url,
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "lengths", "trace_arrivals", "slo")},
        "slo": args.slo, "results": summaries,
        "requests": {rate: [{"arrival_s": a, "prompt_tokens": len(q.prompt_token_ids), "max_tokens": q.max_tokens,
                             "ignore_eos": q.ignore_eos, **vars(r)} for a, q, r in zip(arrivals, requests, results)]
                     for rate, (arrivals, results, _) in runs.items()},
    })
    return 0 if all(math.isfinite(s["requests_per_s"]) for s in summaries.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
