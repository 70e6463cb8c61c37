"""The sampler's time per step: ``--rows`` rows of ``--vocab`` logits, each kind of request (greedy, temperature 1,
top_p 0.9, seeded), milliseconds per call on one thread.

``--baseline-tree PATH`` also loads ``PATH/engine/sampler.py`` (another checkout of this repository, e.g. a
``git worktree`` at an older commit) beside this one, in the same process, and times the two alternately, round
after round: on a machine whose speed drifts, only figures taken side by side compare.

    python -m benchmarks.micro.sampler --rows 64 --vocab 4096
    git worktree add /tmp/before <commit> && python -m benchmarks.micro.sampler --baseline-tree /tmp/before
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Sequence

import torch

from inflight.engine import sampler as engine_sampler
from benchmarks.common.flags import positive_int
from benchmarks.common.report import load_average, print_table, write_json
from inflight.engine.sampling_params import SamplingParams

CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 1": SamplingParams(temperature=1.0),
    "temperature 1, top_p 0.9": SamplingParams(temperature=1.0, top_p=0.9),
    "temperature 1, top_k 50": SamplingParams(temperature=1.0, top_k=50),
    "temperature 1, seeded": SamplingParams(temperature=1.0, seed=3),
    "temperature 1, logprobs 5": SamplingParams(temperature=1.0, logprobs=5),
}


class _Request:  # what a sampler reads of a row's request
    index = 0
    request_id = "bench"


def load_sampler(tree: str) -> ModuleType:
    path = Path(tree) / "engine" / "sampler.py"
    if not path.is_file():
        raise ValueError(f"--baseline-tree: no engine/sampler.py under {tree}")
    spec = importlib.util.spec_from_file_location("baseline_sampler", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def make_batch(module: ModuleType, params: SamplingParams, rows: int):
    """A ``SamplingBatch`` of ``rows`` identical rows, for this sampler or an older one (which took a
    ``torch.Generator`` per seeded row)."""
    fields = {f.name for f in dataclasses.fields(module.SamplingBatch)}
    extra = {"generators": [torch.Generator() if params.seed is not None else None] * rows} if "generators" in fields else {}
    return module.SamplingBatch(params=[params] * rows, num_output_tokens=[5] * rows, eos_token_ids=frozenset([1]),
                                requests=[_Request()] * rows, **extra)


def time_call(module: ModuleType, logits: torch.Tensor, params: SamplingParams, calls: int) -> float:
    sampler, batch = module.Sampler(0), make_batch(module, params, logits.shape[0])
    sampler(logits, batch)  # first call: allocations
    started = time.perf_counter()
    for _ in range(calls):
        sampler(logits, batch)
    return (time.perf_counter() - started) / calls * 1e3


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.micro.sampler", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=positive_int, default=64, help="sampled rows per call")
    parser.add_argument("--vocab", type=positive_int, default=4096, help="logits per row")
    parser.add_argument("--rounds", type=positive_int, default=5, help="rounds (the median is reported)")
    parser.add_argument("--calls", type=positive_int, default=5, help="calls per case per round")
    parser.add_argument("--baseline-tree", metavar="PATH", help="also time PATH/engine/sampler.py, alternately")
    parser.add_argument("--json", metavar="PATH", help="also write the figures here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    samplers = {"this tree": engine_sampler}
    if args.baseline_tree:
        try:
            samplers = {"baseline": load_sampler(args.baseline_tree), **samplers}
        except ValueError as e:
            raise SystemExit(str(e)) from None
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(0))
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for case, params in CASES.items():
            for name, module in samplers.items():
                times.setdefault((case, name), []).append(time_call(module, logits, params, args.calls))
    medians = {case: {name: statistics.median(times[(case, name)]) for name in samplers} for case in CASES}
    header = ["request kind", *[f"{name}, ms" for name in samplers]] + (["baseline / this"] if len(samplers) > 1 else [])
    rows = [[case, *by_name.values()] + ([f"{by_name['baseline'] / by_name['this tree']:.1f}x"]
                                         if len(samplers) > 1 else []) for case, by_name in medians.items()]
    print_table(f"sampler, {args.rows} rows x {args.vocab} logits, one thread, median of {args.rounds} rounds", header, rows)
    print(f"load average {load_average():.2f}")
    write_json(args.json, {"rows": args.rows, "vocab": args.vocab, "ms_per_call": medians})
    return 0


if __name__ == "__main__":
    sys.exit(main())
