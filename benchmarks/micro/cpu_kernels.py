"""The CPU kernels alone (``kernels/cpu_kernels.py``), at the benchmark model's shapes, for each vector width asked.

Median time per call over ``--calls`` calls, one thread unless ``--threads``: decode attention over a paged cache
(rows x context, 8 query heads over 4 kv heads of 32, blocks of 16 scattered through the pool), a fresh prompt's
causal self-attention, the per-token passes between the matmuls, and a decode-sized linear. ``--lanes 8,16``
builds the kernels for vectors of 8 lanes (AVX2's registers) and of 16 (AVX-512's) in turn: on a machine without
AVX-512 the 16-lane build runs on pairs of registers, which shows what the width costs there (``native`` is the
build ``load()`` picks for this machine).

``--matmuls`` prints a second table for the native build: each linear of the benchmark model at decode row counts
(``--rows``) through oneDNN's packed matmul (what ``engine.models.cpu_packing`` uses above ``kernel_rows()``), MKL's
``F.linear`` on the plain weight, and our ``cpu_kernels.linear``. Caches are hot here: in the engine a step reads
more weight than this VM's share of the L3 holds, which favours the layouts read in order (docs/benchmarks-history.md).

    python -m benchmarks.micro.cpu_kernels --lanes native,8,16
    python -m benchmarks.micro.cpu_kernels --matmuls --rows 1,4,16
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from inflight.kernels import cpu_kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 8, 4, 32, 16


def median_ms(fn: Callable[[], object], calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def cases() -> dict[str, Callable[[], object]]:
    gen = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    found = {}
    for rows, context in ((14, 500), (64, 120)):
        blocks_per_row = -(-context // BLOCK)
        pool = rows * blocks_per_row + 8
        k_cache, v_cache = randn(KV_HEADS, pool, BLOCK, HEAD_DIM), randn(KV_HEADS, pool, BLOCK, HEAD_DIM)
        tables = torch.randperm(pool, generator=gen)[:rows * blocks_per_row].reshape(rows, blocks_per_row)
        lens = torch.full((rows,), context, dtype=torch.int64)
        query = randn(rows, HEADS, HEAD_DIM)
        found[f"decode attention, {rows} rows x {context} tokens"] = (
            lambda q=query, k=k_cache, v=v_cache, t=tables, n=lens:
            cpu_kernels.paged_decode_attention(q, k, v, t, n, HEAD_DIM ** -0.5))
    for tokens in (425, 800):
        q, k, v = randn(tokens, HEADS, HEAD_DIM), randn(tokens, KV_HEADS, HEAD_DIM), randn(tokens, KV_HEADS, HEAD_DIM)
        found[f"causal attention, {tokens} tokens"] = (
            lambda q=q, k=k, v=v: cpu_kernels.causal_attention(q, k, v, HEAD_DIM ** -0.5))
    x, residual, weight = randn(425, 256), randn(425, 256), randn(256)
    found["rms_norm + residual, 425 x 256"] = lambda: cpu_kernels.rms_norm(x, weight, 1e-6, residual)
    gate_up = randn(425, 2 * 688)
    found["silu_and_mul, 425 x 688"] = lambda: cpu_kernels.silu_and_mul(gate_up)
    for rows in (1, 13):
        x, packed = randn(rows, 256), cpu_kernels.pack_linear(randn(1376, 256))
        name = f"linear, {rows} row{'s' * (rows > 1)} x 256 -> 1376"
        found[name] = lambda x=x, w=packed: cpu_kernels.linear(x, w, None, 1376)
    return found


# (in, out) of the benchmark model's linears: q/k/v fused, o, gate/up fused, down, LM head
MODEL_LINEARS = ((256, 512), (256, 256), (256, 1376), (688, 256), (256, 4096))


def matmul_rows(rows: list[int], calls: int) -> list[str]:
    """Markdown rows: in x out, rows, then ms per call of oneDNN packed, MKL on the plain weight, our kernel."""
    gen = torch.Generator().manual_seed(1)
    lines = []
    for in_features, out_features in MODEL_LINEARS:
        weight = torch.randn(out_features, in_features, generator=gen)
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        ours = cpu_kernels.pack_linear(weight)
        for count in rows:
            x = torch.randn(count, in_features, generator=gen)
            times = [median_ms(lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""), calls),
                     median_ms(lambda: F.linear(x, weight), calls),
                     median_ms(lambda: cpu_kernels.linear(x, ours, None, out_features), calls)]
            cells = " | ".join(f"{t:.4f}" for t in times)
            lines.append(f"| {in_features} x {out_features} | {count} | {cells} |")
    return lines


def run_lanes(lanes: str, calls: int) -> dict[str, float]:
    if lanes == "native":
        os.environ.pop("INFLIGHT_CPU_KERNEL_LANES", None)
    else:
        os.environ["INFLIGHT_CPU_KERNEL_LANES"] = lanes
    cpu_kernels.load.cache_clear()
    if cpu_kernels.load() is None:
        raise SystemExit("the CPU kernels did not build (see the log above)")
    return {name: median_ms(fn, calls) for name, fn in cases().items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lanes", default="native", help="comma-separated builds: native, 8, 16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--matmuls", action="store_true", help="also oneDNN, MKL and our kernel at decode rows")
    parser.add_argument("--rows", default="1,4,16", help="with --matmuls: comma-separated row counts")
    args = parser.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error(f"--rows: comma-separated whole numbers, got {args.rows!r}")
    if any(r < 1 for r in rows):
        parser.error(f"--rows: each at least 1, got {args.rows!r}")
    builds = args.lanes.split(",")
    for lanes in builds:
        if lanes not in ("native", "8", "16"):
            parser.error(f"--lanes: each must be native, 8 or 16, got {lanes!r}")
    torch.set_num_threads(args.threads)
    results = {lanes: run_lanes(lanes, args.calls) for lanes in builds}
    header = "| kernel, shape (ms, median) | " + " | ".join(f"{lanes} lanes" for lanes in builds) + " |"
    print(header)
    print("|---" * (len(builds) + 1) + "|")
    for name in results[builds[0]]:
        print(f"| {name} | " + " | ".join(f"{results[lanes][name]:.3f}" for lanes in builds) + " |")
    if args.matmuls:
        run_lanes("native", 1)  # the build load() picks here
        print()
        print("| in x out | rows | oneDNN packed (ms) | MKL F.linear (ms) | cpu_kernels.linear (ms) |")
        print("|---|---|---|---|---|")
        for line in matmul_rows(rows, args.calls):
            print(line)


if __name__ == "__main__":
    main()
