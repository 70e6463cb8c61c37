"""The engine's host time per step, with the model runner replaced by a stand-in that returns at once.

``--num-requests`` requests (demo-tiny, ``--prompt-len``-token prompts, ``ignore_eos``) are prefilled and
decoded until each holds ``--decoded-tokens`` output tokens; then ``--steps`` decode steps of every
request are timed. That is repeated ``--repeats`` times from fresh requests (so outputs, which are copied
every step, do not grow from block to block); ``us_per_step`` is the median wall time over the blocks.
The thread's CPU time is shown next to it: on a shared machine the difference is time spent waiting for a core.

What a step costs here is the engine's side of it: scheduling, block bookkeeping, input preparation (the
step's ``SchedulerOutput``: token ids, positions, block tables) and output processing (the scheduler's
update, incremental detokenization, ``RequestOutput``s). The runner's own work, turning that batch into
arrays and tensors for the attention backend and the model, goes with the stand-in.

A second pass times each part by wrapping it (exclusive time: block bookkeeping is taken out of
scheduling); the wrappers cost a little, so that pass's total is shown next to the plain one.

The seed puts scheduling at 5-10% of a GPU step at batch 256 (2-4 ms of 40 ms); the target here is at
most 1 ms per step at 256 running requests.

    python -m benchmarks.scheduler --num-requests 256 --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from typing import Any, Callable, Sequence

import torch
from tqdm import tqdm

from benchmarks.report import describe_machine, load_average, print_table, pyplot, save_figure, write_json
from benchmarks.workloads import positive_int
from engine.sampling_params import OUTPUT_KINDS

TARGET_US_PER_STEP = 1000.0
STAND_IN_TOKEN_ID = 72  # demo-tiny's "b": a printable ASCII byte, so every token becomes text as in a real run
PARTS = ("scheduling", "block bookkeeping", "input preparation", "output processing", "engine loop")


def stand_in_execute(runner) -> Callable:
    """``ModelRunner.execute`` replaced by a stand-in that returns at once: a fixed token for every sampled row."""
    from engine.model_runner import RunnerOutput

    def execute(batch, sampling):
        return RunnerOutput([STAND_IN_TOKEN_ID if s else None for s in batch.sample], [None] * batch.num_rows)

    return execute


def build_engine(args):
    from engine import LLMEngine

    blocks_per_request = -(-(args.prompt_len + args.max_tokens) // args.block_size)
    engine = LLMEngine("demo-tiny", device="cpu", num_threads=1, batching=args.batching,
                       max_num_seqs=args.num_requests, max_num_batched_tokens=args.max_num_batched_tokens,
                       block_size=args.block_size, num_kv_blocks=args.num_requests * blocks_per_request,
                       max_model_len=args.prompt_len + args.max_tokens)
    engine.runner.execute = stand_in_execute(engine.runner)
    return engine


def start_requests(engine, args, block: int) -> None:
    """End whatever runs, then bring ``--num-requests`` fresh requests to ``--decoded-tokens`` output tokens
    each: every timed block starts from the same state, so outputs do not grow from block to block."""
    from engine import SamplingParams

    for request_id in list(engine._children):
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                            output_kind=args.output_kind)
    for i in range(args.num_requests):
        prompt = [7 + (i * 13 + j) % 256 for j in range(args.prompt_len)]  # distinct byte-id prompts
        engine.add_request(f"{block}-{i}", prompt, params)
    scheduler = engine.scheduler
    while (scheduler.waiting or len(scheduler.running) < args.num_requests
           or min(r.num_output_tokens for r in scheduler.running) < args.decoded_tokens):
        engine.step()


def time_steps(engine, steps: int, num_requests: int) -> tuple[float, float]:
    """(wall, CPU) microseconds per step over ``steps`` decode steps of every request. The host path is one
    thread, so its CPU time is its cost without the waits a busy machine adds to the wall time."""
    start, cpu_start = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        engine.step()
    elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
    if engine.last_batch_size != num_requests:
        raise RuntimeError(f"{engine.last_batch_size} of {num_requests} requests in the batch while being timed")
    return elapsed / steps * 1e6, cpu / steps * 1e6


class PartTimer:
    """Exclusive wall time per named part: a wrapped call's time minus that of wrapped calls inside it."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._clock = clock
        self._children: list[float] = []

    def wrap(self, part: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            self._children.append(0.0)
            start = self._clock()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = self._clock() - start
                self.seconds[part] += elapsed - self._children.pop()
                if self._children:
                    self._children[-1] += elapsed
        return timed


def time_parts(engine, steps: int) -> dict[str, float]:
    """Microseconds per step of each part, from a pass with every part wrapped."""
    timer = PartTimer()
    scheduler, kv, processor, runner = engine.scheduler, engine.scheduler.kv, engine.output_processor, engine.runner
    wrapped = [(engine, "step", "engine loop"), (scheduler, "schedule", "scheduling"),
               (kv, "allocate", "block bookkeeping"), (kv, "free", "block bookkeeping"),
               (scheduler, "_build_output", "input preparation"), (runner, "execute", "input preparation"),
               (scheduler, "update", "output processing"), (processor, "process_tokens", "output processing"),
               (processor, "make_output", "output processing")]
    for owner, name, part in wrapped:
        setattr(owner, name, timer.wrap(part, getattr(owner, name)))
    try:
        for _ in tqdm(range(steps), desc="timed parts", unit="step", file=sys.stderr, leave=False):
            engine.step()
    finally:
        for owner, name, _ in wrapped:
            if name != "execute":
                delattr(owner, name)  # back to the class's method
        runner.execute = stand_in_execute(runner)
    return {part: timer.seconds[part] / steps * 1e6 for part in PARTS}


def plot(parts: dict[str, float], us_per_step: float, num_requests: int, path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3))
    left = 0.0
    for i, (part, us) in enumerate(parts.items()):
        ax.barh([0], [us], left=left, color=f"C{i}", label=f"{part} {us:.0f} us")
        left += us
    ax.axvline(TARGET_US_PER_STEP, color="black", linestyle="--", label=f"target {TARGET_US_PER_STEP:.0f} us")
    ax.set_yticks([])
    ax.set_xlabel("microseconds per step (instrumented pass)")
    ax.set_title(f"host time per step, {num_requests} requests decoding; plain pass: {us_per_step:.0f} us")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3, fontsize=8)
    save_figure(fig, path)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scheduler", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=positive_int, default=256, help="requests decoding in every step")
    parser.add_argument("--steps", type=positive_int, default=50, help="decode steps per timed block")
    parser.add_argument("--repeats", type=positive_int, default=7, help="timed blocks (the median is reported)")
    parser.add_argument("--prompt-len", type=positive_int, default=128, help="prompt tokens per request")
    parser.add_argument("--decoded-tokens", type=positive_int, default=64,
                        help="output tokens each request holds when a block starts (outputs are copied every step)")
    parser.add_argument("--block-size", type=positive_int, default=16, help="KV block size in tokens")
    parser.add_argument("--batching", default="continuous", choices=["continuous", "static"])
    parser.add_argument("--output-kind", default="delta", choices=list(OUTPUT_KINDS),
                        help="what each step's outputs carry (delta: what the serving path uses; cumulative: "
                             "a copy of every request's output so far, every step)")
    parser.add_argument("--json", metavar="PATH", help='also write {"us_per_step": ..., ...} here')
    parser.add_argument("--plot", metavar="PATH.png", help="also draw the breakdown")
    args = parser.parse_args(argv)
    if args.block_size & (args.block_size - 1):
        parser.error(f"--block-size must be a power of two, got {args.block_size}")
    # Nobody may finish while timed. Prefill is spread over steps (the token budget), so the first requests
    # admitted are that many tokens ahead of the last when everyone holds --decoded-tokens.
    args.max_num_batched_tokens = max(2048, args.num_requests)
    prefill_steps = -(-args.num_requests * args.prompt_len // args.max_num_batched_tokens)
    args.max_tokens = args.decoded_tokens + args.steps + prefill_steps + 8
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    engine = build_engine(args)
    blocks, cpu_blocks = [], []
    for block in tqdm(range(args.repeats), desc="timed blocks", unit="block", file=sys.stderr, leave=False):
        start_requests(engine, args, block)
        wall, cpu = time_steps(engine, args.steps, args.num_requests)
        blocks.append(wall)
        cpu_blocks.append(cpu)
    us_per_step, cpu_us_per_step = statistics.median(blocks), statistics.median(cpu_blocks)
    start_requests(engine, args, args.repeats)
    parts = time_parts(engine, args.steps)
    instrumented = sum(parts.values())
    print_table(f"host time per step, {args.num_requests} requests decoding ({args.batching}), microseconds",
                ["part", "us per step", "share"],
                [[part, us, f"{us / instrumented:.0%}"] for part, us in parts.items()]
                + [["total, instrumented pass", instrumented, ""],
                   ["total, plain pass (median of blocks)", us_per_step, ""],
                   ["CPU time of the plain pass (median of blocks)", cpu_us_per_step, ""]])
    verdict = "met" if us_per_step <= TARGET_US_PER_STEP else "MISSED"
    print(f"\nus_per_step {us_per_step:.0f} wall (blocks: {', '.join(f'{b:.0f}' for b in blocks)}), "
          f"{cpu_us_per_step:.0f} CPU; target <= {TARGET_US_PER_STEP:.0f} wall: {verdict}; "
          f"load average {load_average():.2f}")
    if args.plot:
        plot(parts, us_per_step, args.num_requests, args.plot)
    payload: dict[str, Any] = {
        "us_per_step": us_per_step, "target_us_per_step": TARGET_US_PER_STEP, "met": verdict == "met",
        "us_per_step_blocks": blocks, "cpu_us_per_step": cpu_us_per_step, "cpu_us_per_step_blocks": cpu_blocks,
        "breakdown_us_per_step": parts, "instrumented_us_per_step": instrumented,
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "plot")}, "machine": describe_machine(),
    }
    write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
