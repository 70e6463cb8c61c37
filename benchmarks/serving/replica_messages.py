"""Tokens/s through a Serve handle straight to one LLMReplica (no proxy, router or HTTP), by message budget.

Shows what Ray Serve messages cost on this machine: the same 64 streams of demo-tiny, with the
replica allowed ``--max-messages-per-s`` messages in total (fewer messages, more tokens each).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-messages-per-s", type=float, nargs="+", default=[5000, 1000, 200])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from inflight.serve_app.app import make_app
    from inflight.serve_app.config import AppConfig
    from inflight.serve_app.messages import GenerateRequest

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
    params = dict(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    for budget in args.max_messages_per_s:
        config = AppConfig(model="demo-tiny", max_messages_per_s=budget, max_pending_requests=512,
                           engine_args=dict(max_model_len=2048, max_num_seqs=64, num_threads=1))
        serve.run(make_app(config), name="messages", route_prefix=None)
        handle = serve.get_deployment_handle("LLMReplica", app_name="messages").options(stream=True)

        async def one(i: int) -> int:
            tokens = 0
            request = GenerateRequest(f"r{i}-{time.time()}", "completion", params, prompt=[7 + i] * 64)
            async for message in handle.generate.remote(request):
                tokens += sum(len(c.token_ids) for c in getattr(message, "choices", ()))
            return tokens

        async def run() -> float:
            await one(-1)  # warm-up
            start = time.perf_counter()
            counts = await asyncio.gather(*(one(i) for i in range(args.streams)))
            return sum(counts) / (time.perf_counter() - start)

        print(f"max_messages_per_s={budget:g}: {asyncio.run(run()):.0f} tok/s through the handle "
              f"at {args.streams} streams")
        serve.delete("messages")
    ray.shutdown()


if __name__ == "__main__":
    main()
