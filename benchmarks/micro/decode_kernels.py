"""A decode step's bf16 kernels at the real model's shapes, cold, and against another revision's build side by side.

Times, per ``--rows`` (and ``--context`` for attention), two things a bfloat16 decode step spends most of its time in:

* ``linears``: the 120 layer linears of SmolLM2-135M (qkv 576 -> 960, o 576 -> 576, gate/up 576 -> 3,072, down
  1,536 -> 576, 30 layers of distinct random weights: 189 MB, more than this VM's caches hold, as in a real step)
  through ``linear_pairs_bf16``;
* ``attention``: ``paged_decode_attention_bf16`` over 30 layers' caches (9 query heads over 3 kv heads of 64, blocks
  of 16, each row's blocks scattered through a 500-block pool).

``--against REV`` also builds ``kernels/csrc/cpu_kernels.cpp`` as it is at git revision REV and calls the two builds
alternately, ``--calls`` times each (machines are noisy: only side-by-side ratios count); medians are reported.
Needs a build with AVX-512 BF16 (``cpu_kernels.bf16_dot_products()``).

    python -m benchmarks.micro.decode_kernels --rows 1,8,12,16,24,64,512 --against 5f32528
    python -m benchmarks.micro.decode_kernels --what attention --rows 13,16,4,32 --context 500,400,800,300 --against 5f32528
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from inflight.kernels import cpu_kernels

LAYERS = 30
LINEAR_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in)
HEADS, KV_HEADS, HEAD_DIM, POOL_BLOCKS, BLOCK_SIZE = 9, 3, 64, 500, 16


def build(source_text: str, directory: Path, name: str) -> ctypes.CDLL:
    """``source_text`` (the kernels' C++ source) built and loaded as the engine builds and loads its own."""
    source = directory / f"{name}.cpp"
    source.write_text(source_text)
    library = directory / f"{name}.so"
    cpu_kernels.build(os.environ.get("CXX") or "g++", cpu_kernels.FLAGS, library, source)
    return cpu_kernels.declare(ctypes.CDLL(str(library)))


def linears_call(lib, rows: int, layers, threads: int):
    xs = {k: torch.randn(rows, k).bfloat16() for _, k in LINEAR_SHAPES}
    outs = {n: torch.empty(rows, n, dtype=torch.bfloat16) for n, _ in LINEAR_SHAPES}

    def call():
        for layer in layers:
            for (n, k), packed in zip(LINEAR_SHAPES, layer):
                lib.linear_pairs_bf16(xs[k].data_ptr(), packed.data_ptr(), None, outs[n].data_ptr(), rows, n, k, k,
                                      threads)
    return call


def attention_call(lib, rows: int, context: int, caches, threads: int):
    blocks = -(-context // BLOCK_SIZE)
    order = torch.randperm(POOL_BLOCKS, generator=torch.Generator().manual_seed(0))
    tables = torch.stack([order[(i * blocks) % (POOL_BLOCKS - blocks):][:blocks] for i in range(rows)]).contiguous()
    seq_lens = torch.full((rows,), context, dtype=torch.int64)
    query = torch.randn(rows, HEADS, HEAD_DIM).bfloat16()
    out = torch.empty_like(query)

    def call():
        for k_cache, v_cache in caches:
            lib.paged_decode_attention_bf16(query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                            tables.data_ptr(), blocks, seq_lens.data_ptr(), out.data_ptr(), rows,
                                            HEADS, KV_HEADS, HEAD_DIM, POOL_BLOCKS, BLOCK_SIZE, HEAD_DIM ** -0.5,
                                            threads)
    return call


def median_times(calls: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():  # alternating: a burst of load elsewhere hits every build alike
            start = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in seconds.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--what", choices=["linears", "attention"], default="linears")
    parser.add_argument("--rows", default="1,8,16,64", help="comma-separated row counts")
    parser.add_argument("--context", default="500", help="attention: tokens per row, one per --rows entry or one")
    parser.add_argument("--against", metavar="REV", help="also time the kernels' source at this git revision")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=9)
    args = parser.parse_args(argv)
    if not cpu_kernels.bf16_dot_products():
        parser.error("the kernels' build here has no AVX-512 BF16 dot products")
    rows = [int(r) for r in args.rows.split(",")]
    contexts = [int(c) for c in args.context.split(",")]
    if len(contexts) == 1:
        contexts *= len(rows)
    if len(contexts) != len(rows):
        parser.error("--context: one value, or one per --rows entry")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        builds = {"here": build(cpu_kernels.SOURCE.read_text(), Path(tmp), "here")}
        if args.against:
            old = subprocess.run(["git", "show", f"{args.against}:kernels/csrc/cpu_kernels.cpp"], check=True,
                                 capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2]).stdout
            builds = {args.against: build(old, Path(tmp), "against"), **builds}
        if args.what == "linears":
            layers = [[cpu_kernels.pack_linear_pairs((torch.randn(n, k) * 0.02).bfloat16()) for n, k in LINEAR_SHAPES]
                      for _ in range(LAYERS)]
        else:
            shape = (KV_HEADS, POOL_BLOCKS, BLOCK_SIZE, HEAD_DIM)
            caches = [(torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()) for _ in range(LAYERS)]
        print(f"{args.what}, {args.threads} threads, medians of {args.calls} alternating calls (ms for 30 layers)")
        print("| rows | " + ("context | " if args.what == "attention" else "") + " | ".join(builds) +
              (" | here / against |" if args.against else " |"))
        for r, context in zip(rows, contexts):
            calls = {name: (linears_call(lib, r, layers, args.threads) if args.what == "linears"
                            else attention_call(lib, r, context, caches, args.threads)) for name, lib in builds.items()}
            times = median_times(calls, args.calls)
            cells = [f"{t * 1e3:.2f}" for t in times.values()]
            ratio = f" | x{times['here'] / times[args.against]:.2f}" if args.against else ""
            print(f"| {r} | " + (f"{context} | " if args.what == "attention" else "") + " | ".join(cells) + ratio + " |")


if __name__ == "__main__":
    main()
