"""A short offline demo: ``python -m inflight.engine.demo`` (``make demo``), no server.

Asks the default model (SmolLM2-135M-Instruct) a batch of questions through its chat template, with the
continuous batching engine, and prints some answers and what happened in the batch. ``--model demo-tiny``
runs the built-in random-weight model instead (its text is noise).
"""

from __future__ import annotations

import argparse
import time

from inflight.engine import LLM, SamplingParams
from inflight.engine.models.packaged import DEFAULT_MODEL

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 17 times 3?",
             "Write a haiku about the sea.", "Explain dynamic batching in one sentence.", "Say hello in French.",
             "What is the largest ocean on Earth?", "Who wrote Romeo and Juliet?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="a packaged model's name, a .gguf file, a checkpoint directory, or 'demo-tiny'")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--batching", choices=("continuous", "static"), default="continuous")
    args = parser.parse_args()

    llm = LLM(args.model, batching=args.batching, max_num_seqs=8)
    conversations = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(args.num_prompts)]
    # Answers end at different lengths: continuous batching refills a slot as soon as its request ends.
    params = [SamplingParams(max_tokens=64, temperature=0.0 if i < len(QUESTIONS) else 0.8, seed=i)
              for i in range(args.num_prompts)]
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    for out in outputs[:4]:
        question = conversations[int(out.request_id)][0]["content"]
        print(f"[{out.request_id}] {question!r} -> {out.outputs[0].text!r} ({out.outputs[0].finish_reason})")
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    stats = llm.engine.stats()
    print(f"{len(outputs)} requests, {num_tokens} tokens in {elapsed:.2f}s ({num_tokens / elapsed:.0f} tok/s), "
          f"{stats['num_steps']} steps, {stats['num_preemptions']} preemptions, batching={args.batching}")
    if args.model == "demo-tiny":
        print("note: demo-tiny has random weights, so its text is noise")


if __name__ == "__main__":
    main()
