"""The engine's host time per step, with the model runner replaced by a stand-in device.

``--num-requests`` requests (``--model``, by default the real SmolLM2-135M-Instruct, ``demo-tiny`` as these
figures were first taken; ``--prompt-len``-token prompts of the model's ordinary tokens, ``ignore_eos``) are
prefilled and
decoded until each holds ``--decoded-tokens`` output tokens; then ``--steps`` decode steps of every
request are timed. That is repeated ``--repeats`` times from fresh requests (so outputs, when copied
every step, do not grow from block to block); each figure is the median over the blocks. The host
thread's CPU time is shown next to the wall time: on a shared machine the difference is time spent
waiting for a core.

The stand-in device (``StandInDevice``) stands in for a GPU: each launched step occupies it for ``--device-ms``
after the step launched before it, as on a CUDA stream, and the host waits for a step's tokens by sleeping
(no GIL held, no core used), as it waits for a GPU's. Loops (``--loops``): the synchronous one, where the device
waits for all the host work of every step; async scheduling, where the host schedules step N+1 and processes
step N's outputs while the device computes, and the device thread launches N+1 before it collects N; and
``async-collect-first``, async scheduling with the device thread's order before 2026-12-04 (N collected before
N+1 is launched), which an H200 showed hid little (docs/benchmarks-history.md). For each: wall time per step, and
``overhead_us_per_step`` = wall minus the device's busy time (a sleep's overshoot, where nothing was queued behind
it, counts as device time). ``us_per_step`` is the synchronous loop's overhead: its host time per step.

What a step costs here is the engine core's side of it (``LLMEngine.core_step``, what the engine's own process
runs between forwards): scheduling, block bookkeeping, input preparation (the step's ``SchedulerOutput``: token
ids, positions, block tables) and output processing (the scheduler's update, the step's records of new tokens),
and with ``--stand-in model`` (the default) the runner's own host work too: arrays and tensors for the attention
backend and the model, placeholders, the launch, on the thread that computes steps, as on a GPU. ``--stand-in
runner`` replaces the runner's launch as well (how issue 14's targets were first measured). ``--front-end`` times
whole ``LLMEngine.step()``s, as ``LLM.generate`` runs them; otherwise the front end's work on the records
(incremental detokenization, stop strings, ``RequestOutput``s: ``engine.output_processor``), which runs in the
server's process while the core computes its next step, is timed on its own ("front end" below), and so is the
step's report crossing from one process to the other.

A second pass times each part by wrapping it (exclusive time: block bookkeeping is taken out of
scheduling); the wrappers cost a little, so that pass's total is shown next to the plain one.

The seed puts scheduling at 5-10% of a GPU step at batch 256 (2-4 ms of 40 ms). Targets at 256 running
requests: synchronous host time at most 600 us per step; async overhead at most 300 us on an 8 ms step.

    python -m benchmarks.micro.scheduler --num-requests 256 --device-ms 8 --json out.json
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
from collections import defaultdict
from typing import Any, Callable, Sequence

import torch
from tqdm import tqdm

from benchmarks.common.engine import build_engine, drain
from benchmarks.common.flags import positive_int
from benchmarks.common.models import add_model_arg, model_from_args
from benchmarks.common.report import describe_machine, load_average, print_table, pyplot, save_figure, write_json
from inflight.engine.engine_core import settle_heap
from inflight.engine.sampling_params import OUTPUT_KINDS

TARGET_US_PER_STEP = 600.0  # the synchronous loop's host time per step at 256 requests
TARGET_ASYNC_OVERHEAD_US = 300.0  # what the async loop adds to a device step at 256 requests
# what the stand-in model outputs unless told otherwise (demo-tiny's "b"); the benchmark gives it a printable token
# of the model (BenchModel.printable_token_id: "a"), so that every token becomes text as in a real run
STAND_IN_TOKEN_ID = 72
LOOPS = ("sync", "async", "async-collect-first")
PARTS = ("scheduling", "block bookkeeping", "input preparation", "output processing", "engine loop")


class StandInEvent:
    """A CUDA event's stand-in on the stand-in device: reached when the device gets to time ``at``."""

    def __init__(self, device: "StandInDevice", at: float) -> None:
        self.device, self.at = device, at

    def query(self) -> bool:
        return time.perf_counter() >= self.at

    def synchronize(self) -> None:
        self.device.wait_until(self.at)

    def elapsed_time(self, end: "StandInEvent") -> float:
        return (end.at - self.at) * 1e3


class StandInModel:
    """The model's stand-in: no compute; every row's logits pick ``token_id``. They are only as wide as that takes
    (``token_id`` + 1 entries, not the vocabulary): a GPU samples on the device, and a greedy argmax over a real
    model's 49,152 logits on this CPU took 1.5 ms a step at 32 rows, 95% of what was measured as host time."""

    def __init__(self, hidden_size: int, vocab_size: int, token_id: int = STAND_IN_TOKEN_ID) -> None:
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"stand-in token {token_id} is not in the vocabulary of {vocab_size}")
        self.hidden_size = hidden_size
        self.row = torch.zeros(token_id + 1)
        self.row[token_id] = 1.0

    def __call__(self, input_ids, positions, kv_caches, metadata, window_metadata=None) -> torch.Tensor:
        return torch.zeros(len(input_ids), self.hidden_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.row.expand(len(hidden), -1)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden).argmax(dim=-1)


class StandInDevice:
    """A GPU's stand-in under the engine: each launched step occupies it for ``device_ms`` after the step launched
    before it (a stream), and the host waits for a step's tokens the way it waits for a GPU's, in
    ``ModelRunner.collect`` (here ``time.sleep``: no GIL held, no core used). ``busy_between`` is the device's time
    in a window: each step's ``device_ms``, and a sleep's overshoot (~0.1-0.2 ms) where the device had nothing
    queued behind the step (the host learnt of the step that late, which a GPU's wake-up would not add); the host's
    overhead is the wall time beyond it.

    ``level`` says what stands in. ``model``: the model alone, so the runner's own host work (input arrays,
    placeholders, attention metadata, the launch) runs as on a GPU, on the thread that computes steps.
    ``runner``: the runner's launch too, so only the engine core's work runs (how issue 14's targets were
    measured)."""

    def __init__(self, runner, device_ms: float = 0.0, level: str = "model", token_id: int = STAND_IN_TOKEN_ID) -> None:
        from inflight.engine.model_runner import LaunchedStep, RunnerOutput

        self.seconds = device_ms / 1e3
        self.free_at = 0.0
        self.intervals: list[list[float]] = []  # [start, end] of each step on the device, in order
        cfg = runner.model_config
        if level == "model":
            runner.model = StandInModel(cfg.hidden_size, cfg.vocab_size, token_id)
            launch = runner.launch
        else:
            def launch(batch, sampling):
                rows = [i for i, sample in enumerate(batch.sample) if sample]
                tokens = torch.full((len(rows),), token_id, dtype=torch.int64)
                output = RunnerOutput([None] * batch.num_rows, [None] * batch.num_rows)
                return LaunchedStep(output, batch.request_ids, rows, tokens=tokens, host_tokens=tokens)

        def stand_in_launch(batch, sampling):
            step = launch(batch, sampling)
            start = max(self.free_at, time.perf_counter())
            self.free_at = start + self.seconds
            self.intervals.append([start, self.free_at])
            step.started, step.ready = StandInEvent(self, start), StandInEvent(self, self.free_at)
            return step

        runner.launch = stand_in_launch

    def wait_until(self, at: float) -> None:
        remaining = at - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
            woke = time.perf_counter()
            if self.free_at <= at:  # nothing queued behind: the device idles while the sleep overshoots, which a
                self.intervals[-1][1] = self.free_at = woke  # GPU's wake-up would not do: device time, not the host's

    def busy_between(self, start: float, end: float) -> float:
        """Seconds the device was busy between two ``time.perf_counter()`` readings."""
        return sum(max(0.0, min(e, end) - max(s, start)) for s, e in self.intervals)


def stand_in_engine(args, async_scheduling: bool = False):
    blocks_per_request = -(-(args.prompt_len + args.max_tokens) // args.block_size)
    engine = build_engine(args.bench_model.engine_model, device="cpu", num_threads=1, batching=args.batching,
                          max_num_seqs=args.num_requests, max_num_batched_tokens=args.max_num_batched_tokens,
                          block_size=args.block_size, num_kv_blocks=args.num_requests * blocks_per_request,
                          max_model_len=args.prompt_len + args.max_tokens, async_scheduling=async_scheduling,
                          persistent_batch=args.persistent_batch == "on")
    engine.stand_in = StandInDevice(engine.runner, args.device_ms, args.stand_in,  # a benchmark's own attribute
                                    args.stand_in_token_id)
    return engine


def start_requests(engine, args, block: int) -> None:
    """End whatever runs, then bring ``--num-requests`` fresh requests to ``--decoded-tokens`` output tokens
    each: every timed block starts from the same state, so outputs do not grow from block to block."""
    from inflight.engine import SamplingParams

    for request_id in list(engine._children):
        engine.abort_request(request_id)
    drain(engine)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                            output_kind=args.output_kind)
    low, high = args.bench_model.token_range
    span = min(256, high - low)
    for i in range(args.num_requests):
        prompt = [low + (i * 13 + j) % span for j in range(args.prompt_len)]  # distinct prompts of ordinary tokens
        engine.add_request(f"{block}-{i}", prompt, params)
    scheduler = engine.scheduler
    while (scheduler.waiting or len(scheduler.running) < args.num_requests
           or min(r.num_output_tokens for r in scheduler.running) < args.decoded_tokens):
        engine.step()


def time_steps(engine, steps: int, num_requests: int, front_end: bool = False) -> tuple[float, float, float]:
    """(wall, CPU, device) microseconds per step over ``steps`` decode steps of every request: the core's steps,
    or with ``front_end`` whole ``LLMEngine.step``s (the front end's work in the same thread, as ``LLM.generate``
    runs). CPU is the host thread's: its cost without the waits a busy machine adds to the wall time; device is
    the stand-in device's time as the host saw it."""
    device: StandInDevice = engine.stand_in
    step = engine.step if front_end else engine.core_step
    start, cpu_start = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        step()
    end, cpu = time.perf_counter(), time.thread_time() - cpu_start
    elapsed, busy = end - start, device.busy_between(start, end)
    del device.intervals[:-1]  # the one in flight may still grow (wait_until)
    if engine.last_batch_size != num_requests:
        raise RuntimeError(f"{engine.last_batch_size} of {num_requests} requests in the batch while being timed")
    return elapsed / steps * 1e6, cpu / steps * 1e6, busy / steps * 1e6


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
    scheduler, kv, runner = engine.scheduler, engine.scheduler.kv, engine.runner
    device_seconds, engine.stand_in.seconds = engine.stand_in.seconds, 0.0  # host time only: no device time
    wrapped = [(engine, "core_step", "engine loop"), (scheduler, "schedule", "scheduling"),
               (kv, "allocate", "block bookkeeping"), (kv, "free", "block bookkeeping"),
               (scheduler, "_build_batch", "input preparation"), (runner, "execute", "input preparation"),
               (scheduler, "update", "output processing"), (engine._records, "of_touched", "output processing")]
    for owner, name, part in wrapped:
        setattr(owner, name, timer.wrap(part, getattr(owner, name)))
    try:
        for _ in tqdm(range(steps), desc="timed parts", unit="step", file=sys.stderr, leave=False):
            engine.core_step()
    finally:
        for owner, name, _ in wrapped:
            delattr(owner, name)  # back to the class's method
        engine.stand_in.seconds = device_seconds
    return {part: timer.seconds[part] / steps * 1e6 for part in PARTS}


def time_front_end(engine, steps: int) -> float:
    """Microseconds per step of the front end (``OutputProcessor.process``: detokenization, stop strings, the
    ``RequestOutput``s) on the records of ``steps`` core steps: the server's process does this per step while
    the engine's process computes the next one (in ``LLMEngine.step`` both run one after the other)."""
    front_end, seconds = engine.output_processor, 0.0
    for _ in range(steps):
        records = engine.core_step()
        start = time.perf_counter()
        front_end.process(records)
        seconds += time.perf_counter() - start
    return seconds / steps * 1e6


def time_report(engine, repeats: int = 50) -> tuple[float, float]:
    """(send, receive) microseconds of one step's report to the server's process, as the engine's own process
    (``engine_process=True``, what servers run) pickles it after every step and the server unpickles it: the
    records of a decode step of every request."""
    from inflight.engine.core_messages import StepReport

    report = StepReport(engine.core_step(), seconds=0.0, batch_size=engine.last_batch_size)
    start = time.perf_counter()
    for _ in range(repeats):
        data = pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL)
    sent = time.perf_counter()
    for _ in range(repeats):
        pickle.loads(data)
    received = time.perf_counter()
    return (sent - start) / repeats * 1e6, (received - sent) / repeats * 1e6


def count_opcodes(engine, steps: int) -> float:
    """Python bytecode instructions the host executes per step (``sys.settrace`` with opcode events, over ``steps``
    steps): a count, not a time, so it does not move with a machine's speed. Two versions of the engine compare
    exactly this way on a machine whose timing swings by tens of percent between runs (this one's does). Tracing
    makes the steps ~50x slower; only the count is kept."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "opcode":
            count += 1
        return local

    def on_call(frame, event, arg):
        frame.f_trace_opcodes = True
        return local

    sys.settrace(on_call)
    try:
        for _ in range(steps):
            engine.core_step()
    finally:
        sys.settrace(None)
    return count / steps


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
    parser = argparse.ArgumentParser(prog="python -m benchmarks.micro.scheduler", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(parser, what=" whose engine is timed (its weights are loaded; the stand-in replaces its forward)")
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
    parser.add_argument("--device-ms", type=float, default=0.0,
                        help="each step's stand-in forward sleeps this long without holding the GIL (a GPU step as "
                             "the host sees it): the async loop hides its host work behind it")
    parser.add_argument("--persistent-batch", default="on", choices=["on", "off"],
                        help="decode steps over an unchanged running set from the scheduler's persistent batch (on, "
                             "the engine's default) or through the general path every step (off: engine argument "
                             "persistent_batch=False, for comparison)")
    parser.add_argument("--stand-in", default="model", choices=["model", "runner"],
                        help="what the stand-in device replaces: the model (the runner's host work runs, as on a GPU) "
                             "or the runner's launch too (only the engine core's work runs: issue 14's measure)")
    parser.add_argument("--front-end", action="store_true",
                        help="time whole LLMEngine.step()s: the front end (text, stop strings, outputs) in the same "
                             "thread, as LLM.generate runs; by default the core's steps, as the engine's process runs")
    parser.add_argument("--loops", default="sync,async",
                        help="which engine loops to time, comma-separated: sync, async, and async-collect-first "
                             "(async scheduling with the device thread's order before 2026-12-04: each step collected "
                             "before the next is launched, so the device waits for that thread's launch work)")
    parser.add_argument("--no-settle-heap", dest="settle_heap", action="store_false",
                        help="leave the garbage collector as it is (the engine's process freezes the heap built "
                             "before its loop and raises the young generation's threshold: engine_core.settle_heap)")
    parser.add_argument("--opcodes", action="store_true",
                        help="also count the Python opcodes the synchronous loop's host runs per step (a measure "
                             "independent of the machine's speed, for comparing two versions of the engine)")
    parser.add_argument("--json", metavar="PATH", help='also write {"us_per_step": ..., ...} here')
    parser.add_argument("--plot", metavar="PATH.png", help="also draw the breakdown")
    args = parser.parse_args(argv)
    if args.block_size & (args.block_size - 1):
        parser.error(f"--block-size must be a power of two, got {args.block_size}")
    if args.device_ms < 0:
        parser.error(f"--device-ms must be >= 0, got {args.device_ms}")
    args.loops = [name.strip() for name in args.loops.split(",") if name.strip()]
    if not args.loops or set(args.loops) - set(LOOPS):
        parser.error(f"--loops must name some of {', '.join(LOOPS)}, got {','.join(args.loops)!r}")
    if set(args.loops) - {"sync"} and args.batching == "static":
        parser.error("--loops async needs --batching continuous")
    # Nobody may finish while timed. Prefill is spread over steps (the token budget), so the first requests
    # admitted are that many tokens ahead of the last when everyone holds --decoded-tokens.
    args.max_num_batched_tokens = max(2048, args.num_requests)
    prefill_steps = -(-args.num_requests * args.prompt_len // args.max_num_batched_tokens)
    args.max_tokens = args.decoded_tokens + args.steps + prefill_steps + 8
    args.bench_model = model_from_args(parser, args)
    try:
        args.stand_in_token_id = args.bench_model.printable_token_id()
    except ValueError as e:
        parser.error(str(e))
    return args


def collect_first(engine) -> None:
    """The device thread's order before launch-ahead (an A/B baseline): each step collected before the next one is
    launched, so the device waits for the launch work of every step."""
    launcher = engine._launcher

    def launch_on_device(batch, sampling, done):
        launcher._collect_on_device()
        try:
            step = engine.runner.launch(batch, sampling)
        except BaseException as error:
            done.set_exception(error)
            return
        launcher._uncollected = (step, done)
        launcher._collect_on_device()

    launcher._launch_on_device = launch_on_device


def time_loop(args, name: str) -> dict[str, Any]:
    """Median microseconds per step of one loop over ``--repeats`` blocks: wall, the host thread's CPU, and the
    overhead (wall minus ``--device-ms``: what the host adds to the device's time)."""
    engine = stand_in_engine(args, name != "sync")
    if name == "async-collect-first":
        collect_first(engine)
    if args.settle_heap:
        settle_heap()  # as the engine's own process does before its loop
    blocks, cpu_blocks, overhead_blocks, device_blocks = [], [], [], []
    for block in tqdm(range(args.repeats), desc=f"timed blocks, {name}", unit="block", file=sys.stderr, leave=False):
        start_requests(engine, args, block)
        wall, cpu, device = time_steps(engine, args.steps, args.num_requests, args.front_end)
        blocks.append(wall)
        cpu_blocks.append(cpu)
        device_blocks.append(device)
        overhead_blocks.append(wall - device)
    return {"engine": engine, "wall_us_per_step": statistics.median(blocks),
            "overhead_us_per_step": statistics.median(overhead_blocks),
            "device_us_per_step": statistics.median(device_blocks), "cpu_us_per_step": statistics.median(cpu_blocks),
            "wall_us_per_step_blocks": blocks, "overhead_us_per_step_blocks": overhead_blocks,
            "cpu_us_per_step_blocks": cpu_blocks}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    loops = {name: time_loop(args, name) for name in args.loops}
    payload: dict[str, Any] = {
        "device_ms": args.device_ms,
        "loops": {name: {k: v for k, v in loop.items() if k != "engine"} for name, loop in loops.items()},
        "model": args.bench_model.describe(), "stand_in_token_id": args.stand_in_token_id,
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "plot", "bench_model")},
        "machine": describe_machine(),
    }
    print_table(f"microseconds per step, {args.bench_model.name}, {args.num_requests} requests decoding "
                f"({args.batching}, persistent batch {args.persistent_batch}), stand-in device {args.device_ms:g} ms",
                ["loop", "wall", "device (slept)", "overhead (wall - device)", "host thread CPU"],
                [[name, loop["wall_us_per_step"], loop["device_us_per_step"], loop["overhead_us_per_step"],
                  loop["cpu_us_per_step"]] for name, loop in loops.items()])
    verdicts = []
    if "sync" in loops:
        sync = loops["sync"]
        us_per_step = sync["overhead_us_per_step"]  # the synchronous host time: the device waits for all of it
        start_requests(sync["engine"], args, args.repeats)
        parts = time_parts(sync["engine"], args.steps)
        instrumented = sum(parts.values())
        print_table("host time per step of the synchronous loop, by part, microseconds", ["part", "us per step", "share"],
                    [[part, us, f"{us / instrumented:.0%}"] for part, us in parts.items()]
                    + [["total, instrumented pass", instrumented, ""],
                       ["total, plain pass (median of blocks)", us_per_step, ""]])
        met = us_per_step <= TARGET_US_PER_STEP
        verdicts.append(f"sync us_per_step {us_per_step:.0f} (target <= {TARGET_US_PER_STEP:.0f}: "
                        f"{'met' if met else 'MISSED'})")
        payload.update(us_per_step=us_per_step, target_us_per_step=TARGET_US_PER_STEP, met=met,
                       us_per_step_blocks=sync["overhead_us_per_step_blocks"],
                       cpu_us_per_step=sync["cpu_us_per_step"], breakdown_us_per_step=parts,
                       instrumented_us_per_step=instrumented)
        start_requests(sync["engine"], args, args.repeats + 2)
        send_us, receive_us = time_report(sync["engine"])
        start_requests(sync["engine"], args, args.repeats + 3)
        front_end_us = time_front_end(sync["engine"], args.steps)
        print_table("beside the core's step, microseconds per step",
                    ["what", "where", "us per step"],
                    [["the step's report, pickled", "engine's process (after its step)", send_us],
                     ["the step's report, unpickled", "server's process", receive_us],
                     [f"front end: text, stop strings, {args.output_kind} RequestOutputs", "server's process",
                      front_end_us]])
        payload.update(report_send_us_per_step=send_us, report_receive_us_per_step=receive_us,
                       front_end_us_per_step=front_end_us)
        if args.plot:
            plot(parts, us_per_step, args.num_requests, args.plot)
        if args.opcodes:
            start_requests(sync["engine"], args, args.repeats + 1)
            opcodes = count_opcodes(sync["engine"], min(args.steps, 10))
            verdicts.append(f"{opcodes:,.0f} Python opcodes per step ({opcodes / args.num_requests:.0f} per request)")
            payload.update(opcodes_per_step=opcodes)
    if "async" in loops:
        overhead = loops["async"]["overhead_us_per_step"]
        met = overhead <= TARGET_ASYNC_OVERHEAD_US
        verdicts.append(f"async overhead_us_per_step {overhead:.0f} (target <= {TARGET_ASYNC_OVERHEAD_US:.0f} with "
                        f"a device step: {'met' if met else 'MISSED'}{'' if args.device_ms else ', no --device-ms'})")
        payload.update(async_overhead_us_per_step=overhead, target_async_overhead_us=TARGET_ASYNC_OVERHEAD_US,
                       async_met=met)
    print(f"\n{'; '.join(verdicts)}; load average {load_average():.2f}")
    write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
