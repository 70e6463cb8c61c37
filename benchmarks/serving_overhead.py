"""What the serving path costs: the same engine called directly, and through Ray Serve + HTTP.

Measures, side by side in one run, on the built-in demo-tiny model with the demo config's engine
arguments:
  * time to first token at 1 stream (sequential requests) and at 64 concurrent streams, for
    AsyncLLMEngine in this process and for HTTP streaming through the Router and LLMReplica;
  * output tokens/s at 64 concurrent streams through HTTP, against the engine's offline
    throughput (``LLM.generate``) on the same requests.
Targets (issue 3): <= 10 ms TTFT added at p50 with 1 stream; >= 80% of offline throughput at 64 streams.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import httpx
from tqdm import tqdm

from benchmarks.openai_client import stream_completion
from benchmarks.report import format_table, write_json

ENGINE_ARGS = dict(max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=2048)
BASE_URL = "http://127.0.0.1:8000"


def prompts(n: int, length: int) -> list[list[int]]:
    """Distinct token-id prompts (demo-tiny's byte ids start at 7)."""
    return [[7 + (i * 31 + j * 7) % 256 for j in range(length)] for i in range(n)]


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def run_all(one, batch: list, concurrent: bool) -> tuple[list, float]:
    """``one(item)`` for every item, all at once or one after another; returns (results, wall seconds)."""
    start = time.perf_counter()
    if concurrent:
        results = await asyncio.gather(*(one(item) for item in batch))
    else:
        results = [await one(item) for item in batch]
    return list(results), time.perf_counter() - start


# -- the engine directly ------------------------------------------------------------------------------
async def engine_ttfts(engine, batch: list[list[int]], max_tokens: int, concurrent: bool) -> tuple[list[float], float]:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)

    async def one(prompt) -> tuple[float, int]:
        start = time.perf_counter()
        ttft, tokens = None, 0
        async for out in engine.generate(prompt, params):
            if ttft is None and out.outputs[0].new_token_ids:
                ttft = time.perf_counter() - start
            tokens = len(out.outputs[0].token_ids)
        return ttft, tokens

    results, wall = await run_all(one, batch, concurrent)
    return [t for t, _ in results], sum(n for _, n in results) / wall


def offline_tokens_per_s(batch: list[list[int]], max_tokens: int, threads: int) -> float:
    from engine import LLM, SamplingParams

    llm = LLM("demo-tiny", num_threads=threads, **ENGINE_ARGS)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    llm.generate(batch[:2], params)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(batch, params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


# -- through Ray Serve and HTTP --------------------------------------------------------------------------
async def http_ttfts(batch: list[list[int]], max_tokens: int, concurrent: bool) -> tuple[list[float], float, int]:
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=256)) as client:
        async def one(prompt):
            return await stream_completion(client, BASE_URL, "demo-tiny", prompt, max_tokens, ignore_eos=True,
                                           temperature=0)
        results, wall = await run_all(one, batch, concurrent)
    errors = sum(not r.ok for r in results)
    return [r.ttft_s for r in results if r.ok], sum(r.num_tokens for r in results) / wall, errors


def start_server(threads: int):
    import ray
    from ray import serve

    from serve_app.app import make_app
    from serve_app.config import AppConfig

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    config = AppConfig(model="demo-tiny", engine_args={**ENGINE_ARGS, "num_threads": threads},
                       max_pending_requests=512, max_queued_requests_per_replica=256)
    serve.run(make_app(config), name="overhead", route_prefix="/")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--single-requests", type=int, default=20, help="sequential requests for the 1-stream TTFT")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="engine torch threads (the demo config uses 1)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()

    import torch

    from engine import AsyncLLMEngine

    single = prompts(args.single_requests, args.prompt_len)
    many = prompts(args.streams, args.prompt_len)
    rows, results = [], {}
    with tqdm(total=5, desc="serving overhead") as bar:
        torch.set_num_threads(args.threads)

        async def direct():
            engine = AsyncLLMEngine("demo-tiny", num_threads=args.threads, **ENGINE_ARGS)
            await engine_ttfts(engine, single[:2], 4, concurrent=False)  # warm-up
            one = await engine_ttfts(engine, single, args.max_tokens, concurrent=False)
            bar.update()
            many_ = await engine_ttfts(engine, many, args.max_tokens, concurrent=True)
            bar.update()
            await engine.shutdown()
            return one, many_

        (e1, _), (e64, e64_tps) = asyncio.run(direct())
        offline = offline_tokens_per_s(many, args.max_tokens, args.threads)
        bar.update()
        start_server(args.threads)
        asyncio.run(http_ttfts(single[:2], 4, concurrent=False))  # warm-up
        h1, _, err1 = asyncio.run(http_ttfts(single, args.max_tokens, concurrent=False))
        bar.update()
        h64, h64_tps, err64 = asyncio.run(http_ttfts(many, args.max_tokens, concurrent=True))
        bar.update()

    results = {
        "ttft_p50_ms": {"engine_1": p50(e1) * 1e3, "http_1": p50(h1) * 1e3,
                        "engine_64": p50(e64) * 1e3, "http_64": p50(h64) * 1e3},
        "tokens_per_s": {"offline": offline, "engine_64": e64_tps, "http_64": h64_tps},
        "errors": {"http_1": err1, "http_64": err64},
    }
    added = results["ttft_p50_ms"]["http_1"] - results["ttft_p50_ms"]["engine_1"]
    share = h64_tps / offline
    rows = [["1 stream", f"{p50(e1) * 1e3:.1f}", f"{p50(h1) * 1e3:.1f}", f"{added:.1f}", "", ""],
            [f"{args.streams} streams", f"{p50(e64) * 1e3:.1f}", f"{p50(h64) * 1e3:.1f}",
             f"{(p50(h64) - p50(e64)) * 1e3:.1f}", f"{e64_tps:.0f}", f"{h64_tps:.0f}"]]
    print()
    print(format_table(["load", "engine TTFT p50 ms", "HTTP TTFT p50 ms", "added ms", "engine tok/s", "HTTP tok/s"],
                       rows))
    print(f"\noffline throughput {offline:.0f} tok/s; HTTP at {args.streams} streams = {share:.1%} of it "
          f"(target >= 80%: {'met' if share >= 0.8 else 'missed'}); TTFT added at 1 stream {added:.1f} ms "
          f"(target <= 10 ms: {'met' if added <= 10 else 'missed'}); errors {err1 + err64}")
    results.update({"ttft_added_ms_1_stream": added, "http_share_of_offline": share, "config": vars(args),
                    "engine_args": ENGINE_ARGS})
    write_json(args.json, results)


if __name__ == "__main__":
    main()
