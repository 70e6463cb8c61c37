"""A short offline demo: ``python -m engine.demo`` (what ``make run`` does until the server lands).

Runs the built-in ``demo-tiny`` model (random weights: the text is noise) through the continuous
batching engine and prints what happened in the KV cache and the batch.
"""

from __future__ import annotations

import argparse
import time

from engine import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo-tiny", help="checkpoint directory or 'demo-tiny'")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--batching", choices=("continuous", "static"), default="continuous")
    args = parser.parse_args()

    llm = LLM(args.model, batching=args.batching, max_num_seqs=8)
    prompts = [f"Request {i}: tell me about dynamic batching." for i in range(args.num_prompts)]
    # Different lengths on purpose: continuous batching refills a slot as soon as its request ends.
    params = [SamplingParams(max_tokens=8 + 12 * (i % 5), temperature=0.8, seed=i) for i in range(args.num_prompts)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    for out in outputs[:4]:
        print(f"[{out.request_id}] {out.prompt!r} -> {out.outputs[0].text!r} ({out.outputs[0].finish_reason})")
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = llm.engine.stats()
    print(f"{len(outputs)} requests, {num_tokens} tokens in {elapsed:.2f}s ({num_tokens / elapsed:.0f} tok/s), "
          f"{stats['num_steps']} steps, {stats['num_preemptions']} preemptions, batching={args.batching}")
    print("note: demo-tiny has random weights, so its text is noise; pass --model PATH for a real checkpoint")


if __name__ == "__main__":
    main()
