"""What driving tensor-parallel ranks costs a decode step (issue 42), on the CPU, and the step at 1 and 2 ranks.

Two measurements, side by side in one run:

* **Steps**: for each count in ``--rows``, that many requests (``--prompt-len``-token prompts, each its own) decode
  ``--tokens`` tokens together in our ``LLMEngine`` on ``--model`` (default the real model, bfloat16, dequantized),
  at ``tensor_parallel_size`` 1 (``--threads`` threads) and 2 (one thread a rank, each rank on its own core),
  alternately ``--rounds`` times; the median decode step of each. Rank 0 counts what it sends and sums per step.
* **The cost of driving the ranks**, measured apart so that waiting for a slower rank does not count as cost: two
  processes on their own cores run the step's collectives in lockstep (``--iterations`` times each): an all-reduce
  of [rows, hidden] in the model's dtype (two a layer and one for the embedding), the gather of each rank's best
  token ([rows, 2] float64, a greedy step), and rank 0 putting the step's message in the step channel (a real step's
  ``SchedulerOutput``, its block tables as changes) while the other takes it. Their sum per step, as a share of the
  two-rank step, is the overhead (issue 42's target: under 10% at 64 rows).

    python -m benchmarks.micro.tensor_parallel --rows 1,64,256 --json benchmarks/results/tensor-parallel-cpu.json
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

from benchmarks.common.flags import comma_separated, positive_int
from benchmarks.common.models import add_model_arg, model_from_args
from benchmarks.common.report import print_table, write_json
from benchmarks.micro.decode_steps import step_times

PROMPT_STEPS = 4  # the prompts' steps, left out of the decode median


def row_counts(text: str) -> list[int]:
    return [positive_int(v) for v in comma_separated(text, str, "row counts")]


def decode_steps(engine, rows: int, prompt_len: int, tokens: int, token_range: tuple[int, int]) -> list[float]:
    """Seconds of each decode step while ``rows`` requests decode ``tokens`` tokens together."""
    return step_times(engine, rows, prompt_len, tokens, token_range, skip=PROMPT_STEPS)


class StepCounter:
    """Rank 0's collectives and step messages per step (wrapping its ``ShmCollectives`` and ``RankWorkers``)."""

    def __init__(self, runner) -> None:
        self.calls: collections.Counter = collections.Counter()
        self.messages: list = []
        parallel = runner.parallel
        for name in ("all_reduce", "gather", "broadcast"):
            self._count(parallel.comm, name)
        send = parallel.workers.send_step

        def counted_send(batch, greedy):
            self.messages.append(batch)
            return send(batch, greedy)

        parallel.workers.send_step = counted_send

    def _count(self, comm, name: str) -> None:
        original = getattr(comm, name)

        def counted(tensor):
            self.calls[(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))] += 1
            return original(tensor)

        setattr(comm, name, counted)


def build(model, size: int, rows: int, threads: int, dtype: str, prompt_len: int, tokens: int):
    from benchmarks.common.engine import build_engine, engine_args

    blocks = rows * -(-(prompt_len + tokens) // 16) + 8
    args = engine_args("continuous", max(rows, 1), max(2048, rows), threads if size == 1 else 1,
                       num_kv_blocks=blocks, dtype=dtype)
    return build_engine(model.engine_model, **args, tensor_parallel_size=size)


def _lockstep_rank(rank: int, region: str, channel_region: str, shapes: list, messages: list, iterations: int,
                   out: str) -> None:
    """One of two processes timing the collectives and the step channel in lockstep."""
    import torch

    from inflight.engine.parallel.collectives import ShmCollectives
    from inflight.engine.parallel.step_channel import StepChannel, StepDecoder, StepEncoder

    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    comm = ShmCollectives.attach(region, rank, 2)
    channel = StepChannel.attach(channel_region, 1, 0) if rank else None
    results = {}
    for kind, shape, dtype in shapes:
        tensor = torch.randn(shape).to(getattr(torch, dtype))
        op = getattr(comm, kind)
        for _ in range(10):
            op(tensor.clone())
        samples = []
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(iterations):
                op(tensor)
                if kind == "all_reduce":
                    tensor.mul_(0.5)  # (keep the values finite)
            samples.append((time.perf_counter() - started) / iterations)
        results[kind] = statistics.median(samples)  # seconds a call
    # the step channel: rank 0 encodes and puts each real message, rank 1 takes and decodes it, then both go on
    if rank == 0:
        writer = StepChannel.attach(channel_region, 1, None)
        encoder = StepEncoder()
        started = time.perf_counter()
        for message in messages:
            writer.put(("step", (encoder.encode(message), True)), lambda: None)
            comm.min_int(0)  # wait for rank 1 to have it (as the step's first collective would)
        results["send"] = (time.perf_counter() - started) / max(len(messages), 1)
        writer.close()
    else:
        decoder = StepDecoder()
        for _ in messages:
            decoder.decode(channel.get()[1][0])
            comm.min_int(0)
        channel.close()
    if rank == 0:
        import json

        with open(out, "w") as f:
            json.dump(results, f)
    comm.close()


def lockstep_costs(shapes: list, messages: list, iterations: int) -> dict:
    import json
    import tempfile

    import torch.multiprocessing as mp

    from inflight.engine.parallel.collectives import ShmCollectives
    from inflight.engine.parallel.step_channel import StepChannel

    owner = ShmCollectives.create(2)
    channel = StepChannel.create(1)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "costs.json")
        try:
            mp.start_processes(_lockstep_rank, args=(owner.region.name, channel.region.name, shapes, messages,
                                                     iterations, out), nprocs=2, start_method="spawn")
        finally:
            owner.close()
            channel.close()
        with open(out) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arg(parser)
    parser.add_argument("--rows", type=row_counts, default=[1, 64, 256], help="comma-separated row counts")
    parser.add_argument("--prompt-len", type=positive_int, default=32)
    parser.add_argument("--tokens", type=positive_int, default=48,
                        help=f"tokens each request decodes (more than {PROMPT_STEPS})")
    parser.add_argument("--rounds", type=positive_int, default=2, help="alternating runs of each system")
    parser.add_argument("--threads", type=positive_int, default=2, help="torch threads of the one-rank engine")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--iterations", type=positive_int, default=200,
                        help="lockstep repetitions of each collective")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.tokens <= PROMPT_STEPS:
        parser.error(f"--tokens: must be more than {PROMPT_STEPS} (the steps left out of the median)")
    model = model_from_args(parser, args)
    rows_list = args.rows
    cfg = model.source().config

    step_ms: dict = collections.defaultdict(list)
    per_step_calls, messages = {}, {}
    for rows in rows_list:
        for _ in range(args.rounds):
            for size in (1, 2):
                engine = build(model, size, rows, args.threads, args.dtype, args.prompt_len, args.tokens)
                try:
                    counter = StepCounter(engine.runner) if size == 2 else None
                    decode_steps(engine, 1, args.prompt_len, 8, model.token_range)  # warm-up
                    if counter is not None:
                        counter.calls.clear()
                        counter.messages.clear()
                    times = decode_steps(engine, rows, args.prompt_len, args.tokens, model.token_range)
                    step_ms[(rows, size)].append(1e3 * statistics.median(times))
                    if counter is not None:
                        num_steps = len(counter.messages)
                        per_step_calls[rows] = {k: v / num_steps for k, v in counter.calls.items()}
                        messages[rows] = counter.messages[PROMPT_STEPS:]
                finally:
                    engine.close()
                print(f"rows {rows}, {size} rank(s): {step_ms[(rows, size)][-1]:.2f} ms a decode step", flush=True)

    table, results = [], []
    for rows in rows_list:
        # a decode step's collectives: two all-reduces a layer and the embedding's, one gather of the best tokens
        shapes = [("all_reduce", [rows, cfg.hidden_size], args.dtype), ("gather", [rows, 2], "float64")]
        costs = lockstep_costs(shapes, messages[rows], args.iterations)
        all_reduces = 2 * cfg.num_layers + 1
        cost = {"all_reduce": all_reduces * costs["all_reduce"], "gather": costs["gather"], "send": costs["send"]}
        one, two = statistics.median(step_ms[(rows, 1)]), statistics.median(step_ms[(rows, 2)])
        overhead_ms = 1e3 * sum(cost.values())
        table.append([rows, f"{one:.2f}", f"{two:.2f}", f"{two / one:.2f}",
                      f"{1e3 * cost['all_reduce']:.2f}", f"{1e3 * cost['gather']:.3f}", f"{1e3 * cost['send']:.3f}",
                      f"{overhead_ms:.2f} ({100 * overhead_ms / two:.1f}%)"])
        results.append({"rows": rows, "step_ms_tp1": step_ms[(rows, 1)], "step_ms_tp2": step_ms[(rows, 2)],
                        "all_reduces_per_step": all_reduces, "lockstep_s": costs,
                        "collectives_counted_per_step": {repr(k): v for k, v in per_step_calls[rows].items()},
                        "overhead_ms": overhead_ms, "overhead_share_of_tp2_step": overhead_ms / two})
    print_table(f"Tensor parallelism on the CPU: {model.name}, {args.dtype}, decode steps (median of "
                f"{args.rounds} alternating runs) and the cost of driving 2 ranks",
                ["rows", "1 rank ms", "2 ranks ms", "ratio", "all-reduces ms", "gather ms", "step message ms",
                 "cost a step"], table)
    write_json(args.json, {"model": model.name, "dtype": args.dtype, "threads_tp1": args.threads,
                           "prompt_len": args.prompt_len, "tokens": args.tokens, "rounds": args.rounds,
                           "results": results})


if __name__ == "__main__":
    main()
