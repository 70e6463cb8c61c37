"""A decode step of a mixture-of-experts model against a dense one with the same active parameters, by rows.

Two shapes with dummy weights, built from config alone (``load_format="dummy"``): Qwen3-30B-A3B's layer (hidden 2,048,
32 query heads and 4 KV heads of 128, 128 experts of 768, 8 a token) for ``--layers`` layers, and the dense model that
computes as much per token (one MLP of 8 x 768 = 6,144). Each engine decodes ``--tokens`` tokens for each row count
in ``--rows`` (``benchmarks.micro.decode_steps.step_times``: the median step after the prompts'), the two alternating
``--repeats`` times, in bfloat16 (the experts in one kernel call where the CPU has AVX-512 BF16).

A token reads 8 experts' weights, as many bytes as the dense MLP; a step of many rows reads every expert some row
chose (at 64 rows nearly all 128: 16x the dense MLP's bytes), which is where a MoE decode step costs more.

    python -m benchmarks.micro.moe_vs_dense --rows 1,16,64
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.common.flags import comma_separated, positive_int
from benchmarks.common.report import print_table, write_json
from benchmarks.common.workloads import write_shape

ATTENTION = dict(num_attention_heads=32, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6,
                 max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=False)


def shapes(layers: int, hidden: int, experts: int, width: int, top_k: int) -> dict[str, dict]:
    """The MoE model and the dense one whose MLP is as wide as a token's experts together."""
    moe = dict(architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=layers, hidden_size=hidden,
               intermediate_size=top_k * width, num_experts=experts, num_experts_per_tok=top_k,
               moe_intermediate_size=width, norm_topk_prob=True, decoder_sparse_step=1, **ATTENTION)
    dense = dict(architectures=["Qwen3ForCausalLM"], num_hidden_layers=layers, hidden_size=hidden,
                 intermediate_size=top_k * width, **ATTENTION)
    return {"moe": moe, "dense": dense}


def measure(shape: dict[str, dict], rows: list[int], prompt_len: int, tokens: int,
            repeats: int) -> dict[str, dict[int, float]]:
    from benchmarks.micro.decode_steps import step_times
    from inflight.engine import LLMEngine

    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in rows} for name in ("moe", "dense")}
    with tempfile.TemporaryDirectory() as tmp:
        engines = {}
        for name, config in shape.items():
            path = write_shape(Path(tmp) / name, config)
            blocks = max(rows) * -(-(prompt_len + tokens) // 16) + 1
            engines[name] = LLMEngine(str(path), load_format="dummy", dtype="bfloat16", block_size=16,
                                      num_kv_blocks=blocks, max_num_seqs=max(64, max(rows)),
                                      max_num_batched_tokens=2048, enable_prefix_caching=False)
            step_times(engines[name], 1, prompt_len, 8)  # warm-up (oneDNN's kernels for each row count)
        for _ in range(repeats):
            for count in rows:
                for name, engine in engines.items():  # alternating
                    times[name][count].extend(step_times(engine, count, prompt_len, tokens))
        for engine in engines.values():
            engine.close()
    return {name: {n: 1e3 * statistics.median(ts) for n, ts in by_rows.items()} for name, by_rows in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=lambda t: [positive_int(v) for v in comma_separated(t, str, "row counts")],
                        default=[1, 16, 64])
    parser.add_argument("--layers", type=positive_int, default=2)
    parser.add_argument("--hidden", type=positive_int, default=2048)
    parser.add_argument("--experts", type=positive_int, default=128)
    parser.add_argument("--expert-width", type=positive_int, default=768)
    parser.add_argument("--top-k", type=positive_int, default=8)
    parser.add_argument("--prompt-len", type=positive_int, default=32)
    parser.add_argument("--tokens", type=positive_int, default=16)
    parser.add_argument("--repeats", type=positive_int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    shape = shapes(args.layers, args.hidden, args.experts, args.expert_width, args.top_k)
    ms = measure(shape, args.rows, args.prompt_len, args.tokens, args.repeats)
    table = [[n, f"{ms['moe'][n]:.2f}", f"{ms['dense'][n]:.2f}", f"{ms['moe'][n] / ms['dense'][n]:.2f}"]
             for n in args.rows]
    print_table(f"A decode step, {args.layers} layers of {args.experts} experts of {args.expert_width}, "
                f"{args.top_k} a token, hidden {args.hidden}, against a dense model of its active parameters, bfloat16, {torch.get_num_threads()} threads (median step, {args.repeats} alternating runs)",
                ["rows", "MoE ms", "dense ms", "MoE / dense"], table)
    write_json(args.json, {"layers": args.layers, "dtype": "bfloat16", "threads": torch.get_num_threads(),
                           "hidden": args.hidden, "experts": args.experts, "expert_width": args.expert_width,
                           "top_k": args.top_k,
                           "results": [{"rows": n, "moe_ms": ms["moe"][n], "dense_ms": ms["dense"][n]}
                                       for n in args.rows]})


if __name__ == "__main__":
    main()
