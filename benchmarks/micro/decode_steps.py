"""How long one decode step of the engine takes, by how many rows it decodes.

For each count in ``--rows``: that many requests with ``--prompt-len``-token prompts go into our
``LLMEngine`` (the benchmark checkpoint, continuous batching, ``--threads`` torch threads) and decode
``--tokens`` tokens each, with KV for all of them; the median ``core_step`` after the prompts' steps is reported,
over ``--repeats`` runs of that count. One stream's time per output token is the one-row step; the rest show where
a matmul path stops paying. ``--kernel-rows N`` sets ``engine.models.cpu_packing.KERNEL_ROWS`` (the most rows
our linear kernel takes before oneDNN does; by default what the kernels' build says) for the run: 0 is oneDNN alone.

    python -m benchmarks.micro.decode_steps --rows 1,2,4,8,16 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

# Left out of each run: its prompts' steps. 16 prompts of 400 tokens take 4 steps at 2,048 tokens a step, rows that
# finished their prompt decoding beside the rest in the last ones; a few such mixed steps do not move the median.
PROMPT_STEPS = 3


def step_times(engine, rows: int, prompt_len: int, tokens: int, token_range: tuple[int, int] = (4, 4004),
               skip: int = PROMPT_STEPS) -> list[float]:
    """Seconds of each decode step while ``rows`` requests decode ``tokens`` tokens together (the first ``skip``
    steps, the prompts', left out)."""
    from benchmarks.common.workloads import sampling_params

    low, high = token_range
    for i in range(rows):  # each row its own prompt (ordinary token ids), so each reads its own KV
        prompt = [low + (i + j) % (high - low) for j in range(prompt_len)]
        engine.add_request(f"decode-steps-{time.monotonic_ns()}-{i}", prompt, sampling_params(tokens))
    times = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        engine.core_step()
        times.append(time.perf_counter() - started)
    return times[skip:]


def decode_engine(max_rows: int, prompt_len: int, tokens: int, threads: int):
    """Our engine on the benchmark checkpoint with KV for ``max_rows`` requests at full length (the benchmark's 8,000
    tokens would hold ~11 of 700): no row waits or is preempted, so every step after the prompts decodes all."""
    from benchmarks.common.engine import build_engine, engine_args
    from benchmarks.common.workloads import BLOCK_SIZE, build_checkpoint

    blocks = max_rows * -(-(prompt_len + tokens) // BLOCK_SIZE) + 1
    return build_engine(build_checkpoint(),
                        **engine_args("continuous", max(64, max_rows), 2048, threads, num_kv_blocks=blocks))


def measure(rows: list[int], prompt_len: int, tokens: int, repeats: int, threads: int) -> dict[int, float]:
    """Median decode step in ms for each row count."""
    torch.set_num_threads(threads)
    engine = decode_engine(max(rows), prompt_len, tokens, threads)
    step_times(engine, 1, prompt_len, 20)  # warm-up: oneDNN builds its kernels per row count on first use
    return {count: 1e3 * statistics.median(t for _ in range(repeats)
                                           for t in step_times(engine, count, prompt_len, tokens))
            for count in rows}


def _counts(text: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if any(v < 1 for v in values):
        raise ValueError(text)
    return values


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16", help="comma-separated row counts")
    parser.add_argument("--prompt-len", type=int, default=400)
    parser.add_argument("--tokens", type=int, default=300, help="tokens each request decodes")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kernel-rows", type=int, default=None, help="override cpu_packing.KERNEL_ROWS")
    args = parser.parse_args(argv)
    try:
        rows = _counts(args.rows)
    except ValueError:
        parser.error(f"--rows: comma-separated whole numbers of at least 1, got {args.rows!r}")
    for name in ("prompt_len", "tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.prompt_len + args.tokens > 2048:
        parser.error("--prompt-len plus --tokens must fit the benchmark model's 2,048 positions")
    if args.kernel_rows is not None:
        if args.kernel_rows < 0:
            parser.error(f"--kernel-rows must be at least 0, got {args.kernel_rows}")
        from inflight.engine.models import cpu_packing

        cpu_packing.KERNEL_ROWS = args.kernel_rows
    medians = measure(rows, args.prompt_len, args.tokens, args.repeats, args.threads)
    print("| rows | median decode step (ms) |")
    print("|---|---|")
    for count, ms in medians.items():
        print(f"| {count} | {ms:.3f} |")


if __name__ == "__main__":
    main()
