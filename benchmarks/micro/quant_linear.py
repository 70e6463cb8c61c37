"""A linear on weights kept quantized against the same weights in bfloat16, at the row counts a server sees.

For each of the real model's linear shapes (its layers' qkv, o, gate/up and down, and the LM head) and each row count:

* ``bf16``: the weight dequantized to bfloat16, on ``cpu_kernels.linear_pairs`` (what ``quantization=none`` runs);
* ``q4`` / ``q8``: ``kernels.quantized.quant_linear`` on the weight kept quantized (the layers' Q4_1 as q4, the
  embedding's Q8_0 as q8: what ``quantization=auto`` runs), activations quantized per call;

``bf16`` is also what a kernel that dequantizes inside a bf16 GEMM could do at best (the same GEMM with the
dequantization free): where ``quantized / bf16`` is below 1, that kernel cannot win either.

Medians of ``--calls`` alternating calls, microseconds, on ``--threads`` threads; the weights (random, the model's
shapes) are bigger than the caches only for the LM head, as in a decode step where all 30 layers' weights pass.

    python -m benchmarks.micro.quant_linear --rows 1,8,64,512 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common.report import write_json
from inflight.kernels import cpu_kernels, quantized

# (name, out_features, in_features, format): SmolLM2-135M's linears
SHAPES = [("qkv", 960, 576, "q4"), ("o", 576, 576, "q4"), ("gate_up", 3072, 576, "q4"), ("down", 576, 1536, "q4"),
          ("lm_head", 49152, 576, "q8")]


def random_weight(fmt: str, n: int, k: int) -> quantized.QuantizedWeight:
    scale = torch.rand(n, k // 32) * 0.01
    if fmt == "q4":
        return quantized.pack_q4(torch.randint(0, 16, (n, k)), scale, -8 * scale)
    return quantized.pack_q8(torch.randint(-128, 128, (n, k)), scale)


def median_us(calls: dict[str, callable], repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,64,512")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--shapes", default=",".join(name for name, *_ in SHAPES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not cpu_kernels.bf16_dot_products():
        parser.error("the kernels' build here has no AVX-512 BF16 dot products (the bf16 side of the comparison)")
    torch.set_num_threads(args.threads)
    rows_list = [int(r) for r in args.rows.split(",")]
    wanted = set(args.shapes.split(","))
    results = []
    print(f"{args.threads} thread(s), medians of {args.calls} alternating calls, us "
          f"(quantized kernels on VNNI: {bool(cpu_kernels.load().quant_vnni())})")
    print("| linear | rows | bf16 | kept quantized | quantized / bf16 |")
    print("|---|---|---|---|---|")
    for name, n, k, fmt in SHAPES:
        if name not in wanted:
            continue
        weight = random_weight(fmt, n, k)
        bf16 = quantized.dequantize(weight, torch.bfloat16)
        packed = cpu_kernels.pack_linear_pairs(bf16)
        for rows in rows_list:
            x = torch.randn(rows, k).bfloat16()
            times = median_us({
                "bf16": lambda: cpu_kernels.linear_pairs(x, packed, None, n),
                fmt: lambda: quantized.quant_linear(x, weight),
            }, args.calls if rows < 512 or n < 10000 else max(3, args.calls // 5))
            ratio = times[fmt] / times["bf16"]
            print(f"| {name} {n}x{k} ({fmt}) | {rows} | {times['bf16']:.0f} | {times[fmt]:.0f} | x{ratio:.2f} |",
                  flush=True)
            results.append({"linear": name, "out": n, "in": k, "format": fmt, "rows": rows, "us": times})
    if args.json:
        write_json(args.json, {"threads": args.threads, "calls": args.calls, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
