"""A mixture-of-experts layer's experts: the CPU kernel (every expert in one call, ``kernels/csrc/moe_experts.h``)
against the PyTorch loop over experts it replaced (``Experts.loop``), on real shapes with random weights, alternately,
in bfloat16 (the kernel runs on AVX-512 BF16's dot products, as the dense linears).

For each shape and row count: ``rows`` tokens routed to ``top_k`` experts each (a random router), the pairs grouped by
expert as the model groups them; each system's median over ``--repeats`` alternating calls. Shapes (one layer):
``qwen3-30b-a3b`` (hidden 2,048, 128 experts of 768, 8 a token) and ``mixtral-8x7b`` (4,096, 8 of 14,336, 2).

    python -m benchmarks.micro.moe_experts --rows 1,16,64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common.flags import comma_separated, positive_int
from benchmarks.common.report import print_table, write_json

SHAPES = {  # hidden, experts, intermediate, top_k
    "qwen3-30b-a3b": (2048, 128, 768, 8),
    "mixtral-8x7b": (4096, 8, 14336, 2),
}


def routed(rows: int, experts: int, top_k: int, generator: torch.Generator) -> list[int]:
    """Pairs per expert when each of ``rows`` tokens picks ``top_k`` distinct experts at random."""
    chosen = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(rows)])
    return torch.bincount(chosen.reshape(-1), minlength=experts).tolist()


def measure(shape: str, rows: int, repeats: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    from inflight.engine.models.llama import Experts
    from inflight.kernels import cpu_kernels

    hidden, experts, inter, top_k = SHAPES[shape]
    g = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * inter ** -0.5).to(dtype)
    counts = routed(rows, experts, top_k, g)
    x = torch.randn(sum(counts), hidden, generator=g).to(dtype)
    packed = dict(gate_up=cpu_kernels.pack_experts(gate_up), down=cpu_kernels.pack_experts(down), inter=inter)
    systems = {"kernel": lambda: cpu_kernels.moe_experts(x, counts, **packed),
               "loop": lambda: Experts.loop(x, counts, gate_up, down)}
    times: dict[str, list[float]] = {name: [] for name in systems}
    for run in systems.values():  # warm-up (oneDNN's primitives, the first call's pages)
        run()
    for _ in range(repeats):
        for name, run in systems.items():
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=lambda t: comma_separated(t, str, "shape names"), default=list(SHAPES))
    parser.add_argument("--rows", type=lambda t: [positive_int(v) for v in comma_separated(t, str, "row counts")],
                        default=[1, 16, 64])
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; known: {', '.join(SHAPES)}")
    from inflight.kernels import cpu_kernels

    if not cpu_kernels.bf16_dot_products():
        parser.error("the MoE kernel needs the CPU kernels built with AVX-512 BF16, which this machine lacks")
    if args.threads:
        torch.set_num_threads(args.threads)
    table, results = [], []
    for shape in args.shapes:
        for rows in args.rows:
            ms = measure(shape, rows, args.repeats)
            table.append([shape, rows, f"{ms['kernel']:.2f}", f"{ms['loop']:.2f}", f"{ms['kernel'] / ms['loop']:.2f}"])
            results.append({"shape": shape, "rows": rows, **{f"{k}_ms": v for k, v in ms.items()}})
            print(f"{shape}, {rows} rows: kernel {ms['kernel']:.2f} ms, loop {ms['loop']:.2f} ms", flush=True)
    print_table(f"A MoE layer's experts, bfloat16, {torch.get_num_threads()} threads (median of {args.repeats} "
                "alternating calls)", ["shape", "rows", "kernel ms", "loop ms", "kernel / loop"], table)
    write_json(args.json, {"dtype": "bfloat16", "threads": torch.get_num_threads(), "repeats": args.repeats,
                           "results": results})


if __name__ == "__main__":
    main()
