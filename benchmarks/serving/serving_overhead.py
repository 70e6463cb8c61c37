"""What the serving path costs: the same engine called directly, and through Ray Serve + HTTP.

Measures, side by side in one run, on ``--model`` (``benchmarks.common.models``: by default the real SmolLM2-135M-Instruct;
``demo-tiny``, the built-in model these figures were first taken on; ``bench-random``, a .gguf file, a checkpoint
directory) with the demo config's engine arguments (float32 on the CPU), on prompts of the model's ordinary tokens:
  * time to first token at 1 stream (sequential requests) for AsyncLLMEngine in this process and
    for HTTP streaming to the Router (on its own port, as ``make run`` serves; ``--ingress proxy``: through
    Serve's proxy) and one LLMReplica;
  * 64 concurrent streams, each sending ``--requests-per-stream`` requests one after another (a
    closed loop, as a benchmark with a concurrency limit runs): TTFT and output tokens/s, directly
    and through HTTP, against the engine's offline throughput (``LLM.generate``) on the same requests. The HTTP
    load runs ``--rounds`` times, each right after an offline run (the server idle meanwhile), after one untimed
    round of both, and the share is the median round's: this machine's speed drifts by tens of percent within a
    minute, and a share of two runs taken a minute apart measured the drift.
``--engine no-work`` puts ``benchmarks.serving.no_work_engine`` behind the same Router and LLMReplica: what
Ray Serve, HTTP and our serving code cost on this machine with no model at all (the floor).
Targets: <= 10 ms TTFT added at p50 with 1 stream (issue 3); >= 75% of offline throughput at 64 streams (issue
13). It also reports the CPU each process (proxy, router, replica, engine, the load generator) spent per request
at 64 streams, read from /proc.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Awaitable, Callable

from tqdm import tqdm

from benchmarks.common.models import BenchModel, add_model_arg, model_from_args
from benchmarks.common.openai_client import client_session, stream_completion
from benchmarks.common.report import format_table, write_json
from benchmarks.common.serve_processes import cpu_by_role, sample_processes
from benchmarks.serving.no_work_engine import STEP_S
from inflight.engine.cpu_list import parse_cpu_list

ENGINE_ARGS = dict(max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=2048)
HOST = "127.0.0.1"


def prompts(n: int, length: int, token_range: tuple[int, int] = (7, 263)) -> list[list[int]]:
    """Distinct token-id prompts of the model's ordinary tokens (default: demo-tiny's byte ids, 7 to 262)."""
    low, high = token_range
    span = min(256, high - low)
    return [[low + (i * 31 + j * 7) % span for j in range(length)] for i in range(n)]


def _own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def closed_loop(one: Callable[[list[int]], Awaitable[tuple]], streams: list[list[list[int]]]) -> tuple[list, float]:
    """Each stream sends its prompts one after another, all streams at once; returns (results, wall seconds)."""
    async def stream(batch: list[list[int]]) -> list:
        return [await one(prompt) for prompt in batch]

    start = time.perf_counter()
    per_stream = await asyncio.gather(*(stream(batch) for batch in streams))
    return [r for results in per_stream for r in results], time.perf_counter() - start


# -- the engine directly ------------------------------------------------------------------------------
async def engine_run(engine, streams: list[list[list[int]]], max_tokens: int) -> tuple[list[float], float]:
    """(TTFTs, output tokens/s) of ``streams`` through an AsyncLLMEngine."""
    from inflight.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)

    async def one(prompt) -> tuple[float, int]:
        start = time.perf_counter()
        ttft, tokens = None, 0
        async for out in engine.generate(prompt, params):
            if ttft is None and out.outputs[0].new_token_ids:
                ttft = time.perf_counter() - start
            tokens = len(out.outputs[0].token_ids)
        return ttft, tokens

    results, wall = await closed_loop(one, streams)
    return [t for t, _ in results], sum(n for _, n in results) / wall


class Offline:
    """The engine offline (``LLM.generate`` of every request at once) in this process: the share's denominator."""

    def __init__(self, threads: int, model: BenchModel) -> None:
        from inflight.engine import LLM

        self.llm = LLM(model.engine_model, num_threads=threads, **ENGINE_ARGS)
        low = model.token_range[0]
        self.tokens_per_s([[low, low + 1, low + 2], [low + 3, low + 4]], 4)  # warm-up

    def tokens_per_s(self, batch: list[list[int]], max_tokens: int) -> float:
        from inflight.engine import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
        start = time.perf_counter()
        outs = self.llm.generate(batch, params)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


# -- through Ray Serve and HTTP --------------------------------------------------------------------------
async def http_run(streams: list[list[list[int]]], max_tokens: int, base_url: str,
                   model_name: str = "demo-tiny") -> tuple[list[float], float, int]:
    """(TTFTs, output tokens/s, failed requests) of ``streams`` through the server's /v1/completions."""
    async with client_session(256, 300) as session:
        async def one(prompt):
            return await stream_completion(session, base_url, model_name, prompt, max_tokens, ignore_eos=True,
                                           temperature=0)
        results, wall = await closed_loop(one, streams)
    failed = [r for r in results if not r.ok]
    for r in failed[:1]:  # what went wrong, once per run: a count alone says nothing
        print(f"HTTP error: status {r.status}: {r.error}", file=sys.stderr, flush=True)
    return [r.ttft_s for r in results if r.ok], sum(r.num_tokens for r in results) / wall, len(failed)


def start_server(threads: int, no_work: bool, max_messages_per_s: float | None, engine_cpus: str | None = None,
                 stream_channel: bool = True, ingress: str = "router", model: BenchModel | None = None
                 ) -> tuple[str, str | None]:
    """The demo config's deployments served as ``make run`` serves them (access logs off, the API on the router's
    own port, Serve's proxy on the configs' port); returns the URLs of ours and, with ``no_work``, of the bare
    Ray Serve app, on ``ingress``: the routers' own ports, or Serve's proxy. ``model``: what the replica serves
    (None: demo-tiny). With ``engine_cpus``, as ``make
    run`` serves a config with them: the replica's engine process on those CPUs, and this process, so Ray and
    everything it starts (and the load generator), on the others."""
    from inflight.serve_app import ray_env

    # As `make run` starts Ray (ray.init below passes the environment on to Ray's processes), and before ray.serve
    # is imported here: Serve reads its settings once, and the handles this process builds keep them.
    ray_env.apply(local=True)
    import ray
    from ray import serve

    from inflight.serve_app.app import make_app
    from inflight.serve_app.config import AppConfig
    from inflight.serve_app.cpu_plan import cpus_left
    from inflight.serve_app.ports import wait_for_router_url

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    rest = cpus_left(parse_cpu_list(engine_cpus)) if engine_cpus else None
    if rest:
        os.sched_setaffinity(0, rest)  # before Ray starts: its processes inherit the mask
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
    serve.start(http_options={"host": HOST, "port": ray_env.LOCAL_PROXY_PORT}, logging_config={"enable_access_log": False})
    extra = {"max_messages_per_s": max_messages_per_s} if max_messages_per_s else {}
    served = {"model": "demo-tiny"} if model is None else {"model": model.engine_model,
                                                             "served_model_name": model.served_name}
    config = AppConfig(**served, engine_args={**ENGINE_ARGS, "num_threads": threads},
                       max_pending_requests=512, max_queued_requests_per_replica=256, engine_cpus=engine_cpus,
                       stream_channel=stream_channel, **extra)
    engine_cls = None
    if no_work:
        from benchmarks.serving.no_work_engine import NoWorkEngine

        engine_cls = NoWorkEngine

    def url(app_name: str, route_prefix: str) -> str:
        base = (wait_for_router_url(app_name, HOST) if ingress == "router"
                else f"http://{HOST}:{ray_env.LOCAL_PROXY_PORT}")
        return base + route_prefix.rstrip("/")

    serve.run(make_app(config, engine_cls=engine_cls), name="overhead", route_prefix="/")
    if not no_work:
        return url("overhead", "/"), None
    from benchmarks.serving.bare_serve import bare_serve_app

    serve.run(bare_serve_app(), name="bare", route_prefix="/bare")
    return url("overhead", "/"), url("bare", "/bare")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, with ``args.bench_model`` the resolved ``--model``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving.serving_overhead", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(parser, what=" served and run offline (with --engine no-work: only named)")
    parser.add_argument("--engine", choices=("real", "no-work"), default="real")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--requests-per-stream", type=int, default=4, help="at --streams concurrent streams")
    parser.add_argument("--single-requests", type=int, default=20, help="sequential requests for the 1-stream TTFT")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="engine torch threads (the demo config uses 1)")
    parser.add_argument("--max-messages-per-s", type=float, default=None, help="the replica's message budget "
                        "(default: the app's)")
    parser.add_argument("--engine-cpus", default="", help="CPUs for the replica's engine process, Ray on the others "
                        "(as `make run` serves a config with engine_cpus); default: everything shares every CPU, as "
                        "configs/demo.yaml")
    parser.add_argument("--stream-channel", choices=("on", "off"), default="on", help="tokens from the replica to "
                        "the router on the stream channel (the app's default) or as items of Serve's calls")
    parser.add_argument("--persistent-batch", choices=("on", "off"), default="on", help="the engine's persistent "
                        "batch (its default), or the general path every step; offline, direct and served alike")
    parser.add_argument("--ingress", choices=("router", "proxy"), default="router", help="HTTP to the router's own port "
                        "(make run's API port) or through Serve's proxy (a cluster's entry point)")
    parser.add_argument("--rounds", type=int, default=3, help="the 64-stream load through HTTP, each time right "
                        "after the engine offline on the same requests (the server idle meanwhile): each round's share "
                        "is of its own offline run, so a machine that changes speed hits both; the median is reported")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    args.bench_model = model_from_args(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model = args.bench_model
    ENGINE_ARGS["persistent_batch"] = args.persistent_batch == "on"

    import torch

    from inflight.engine import AsyncLLMEngine

    single = [prompts(args.single_requests, args.prompt_len, model.token_range)]  # one stream: one after another
    many = prompts(args.streams * args.requests_per_stream, args.prompt_len, model.token_range)
    streams = [many[i::args.streams] for i in range(args.streams)]
    real = args.engine == "real"
    nan = float("nan")
    e1, e64, e64_tps = [nan], [nan], nan
    with tqdm(total=(3 if real else 2) + args.rounds, desc="serving overhead") as bar:
        torch.set_num_threads(args.threads)
        offline = None
        if real:
            async def direct():
                engine = AsyncLLMEngine(model.engine_model, num_threads=args.threads, **ENGINE_ARGS)
                await engine_run(engine, [single[0][:2]], 4)  # warm-up
                one = await engine_run(engine, single, args.max_tokens)
                bar.update()
                many_ = await engine_run(engine, streams, args.max_tokens)
                bar.update()
                await engine.shutdown()
                return one, many_

            (e1, _), (e64, e64_tps) = asyncio.run(direct())
            offline = Offline(args.threads, model)
        url, bare_url = start_server(args.threads, not real, args.max_messages_per_s,
                                     (args.engine_cpus or None) if real else None, args.stream_channel == "on",
                                     args.ingress, model)
        name = model.served_name
        asyncio.run(http_run([single[0][:2]], 4, url, name))  # warm-up
        if real:
            h1, _, err1 = asyncio.run(http_run(single, args.max_tokens, url, name))
        else:  # ours and the bare path in turn, request by request: drift on a shared machine hits both
            asyncio.run(http_run([single[0][:2]], 4, bare_url, name))
            pairs = [(asyncio.run(http_run([[p]], args.max_tokens, url, name)),
                      asyncio.run(http_run([[p]], args.max_tokens, bare_url, name))) for p in single[0]]
            h1 = [t for ours, _ in pairs for t in ours[0]]
            e1 = [t for _, bare in pairs for t in bare[0]]
            err1 = sum(ours[2] + bare[2] for ours, bare in pairs)
        bar.update()
        # One untimed round of each first: either side's first batch of this shape pays for oneDNN's kernels for
        # its row counts (the first offline run after start-up came out 15-25% slower than the ones after it).
        if offline is not None:
            offline.tokens_per_s(many, args.max_tokens)
            asyncio.run(http_run(streams, args.max_tokens, url, name))
        rounds, h64, err64, cpu = [], [], 0, {}
        for _ in range(args.rounds):
            offline_tps = offline.tokens_per_s(many, args.max_tokens) if offline is not None else nan
            before, client_before = sample_processes("overhead"), _own_cpu_s()
            ttfts, tps, errors = asyncio.run(http_run(streams, args.max_tokens, url, name))
            for role, seconds in {**cpu_by_role(before, sample_processes("overhead")),
                                  "load generator": _own_cpu_s() - client_before}.items():
                cpu[role] = cpu.get(role, 0.0) + seconds
            rounds.append({"offline": offline_tps, "http_64": tps, "share": tps / offline_tps})
            h64 += ttfts
            err64 += errors
            bar.update()
        num_requests = args.rounds * sum(len(s) for s in streams)
        h64_tps = statistics.median(r["http_64"] for r in rounds)
        if not real:
            e64, e64_tps, bare_errors = asyncio.run(http_run(streams, args.max_tokens, bare_url, name))
            err64 += bare_errors
        bar.update()

    added = (p50(h1) - p50(e1)) * 1e3
    share = statistics.median(r["share"] for r in rounds)
    offline_tps = statistics.median(r["offline"] for r in rounds)
    results = {
        "engine": args.engine,
        # with --engine no-work, "engine_*" is the bare Ray Serve path (benchmarks.serving.no_work_engine.bare_serve_app)
        "ttft_p50_ms": {"engine_1": p50(e1) * 1e3, "http_1": p50(h1) * 1e3,
                        "engine_64": p50(e64) * 1e3, "http_64": p50(h64) * 1e3},
        "tokens_per_s": {"offline": offline_tps, "engine_64": e64_tps, "http_64": h64_tps},
        "rounds": rounds,  # each 64-stream HTTP run, its offline run just before, and the share
        "errors": {"http_1": err1, "http_64": err64},
        "ttft_added_ms_1_stream": added, "http_share_of_offline": share, "model": model.describe(),
        "config": {k: v for k, v in vars(args).items() if k != "bench_model"},
        "engine_args": ENGINE_ARGS, "load_average": os.getloadavg(),
        # CPU each process role spent per request of the 64-stream HTTP run (the engine's process, our deployments,
        # Serve's proxy and controller, this process as the load generator)
        "cpu_ms_per_request_64": {role: 1e3 * seconds / num_requests for role, seconds in cpu.items()},
    }
    base = "engine" if real else "bare Serve"
    rows = [["1 stream", f"{p50(e1) * 1e3:.1f}", f"{p50(h1) * 1e3:.1f}", f"{added:.1f}", "", ""],
            [f"{args.streams} streams", f"{p50(e64) * 1e3:.1f}", f"{p50(h64) * 1e3:.1f}",
             f"{(p50(h64) - p50(e64)) * 1e3:.1f}", f"{e64_tps:.0f}", f"{h64_tps:.0f}"]]
    print(f"\nmodel {model.name} (served as {model.served_name}), prompts of {args.prompt_len} tokens, "
          f"{args.max_tokens} output tokens each")
    print(format_table(["load", f"{base} TTFT p50 ms", "HTTP TTFT p50 ms", "added ms", f"{base} tok/s",
                        "HTTP tok/s"], rows))
    print("\nCPU per request at", args.streams, "streams: " + ", ".join(
        f"{role} {ms:.1f} ms" for role, ms in sorted(results["cpu_ms_per_request_64"].items(), key=lambda x: -x[1])))
    if real:
        print(f"\nrounds (offline tok/s, then HTTP at {args.streams} streams): " + "; ".join(
            f"{r['offline']:.0f} / {r['http_64']:.0f} = {r['share']:.1%}" for r in rounds))
        print(f"offline throughput {offline_tps:.0f} tok/s (median); HTTP at {args.streams} streams = {share:.1%} of "
              f"it in the median round (target >= 75%: {'met' if share >= 0.75 else 'missed'}); TTFT added at 1 stream "
              f"{added:.1f} ms (target <= 10 ms: {'met' if added <= 10 else 'missed'}); errors {err1 + err64}")
    else:
        print(f"\nno-work engine (a token every {STEP_S * 1e3:.0f} ms, no CPU) behind our Router and LLMReplica "
              f"(HTTP) against the bare Ray Serve path (a token per message, nothing else): the serving path's "
              f"floor on this machine; errors {err1 + err64}")
    write_json(args.json, results)


if __name__ == "__main__":
    main()
