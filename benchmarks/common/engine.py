"""Our engine as every benchmark builds it: ``build_engine`` (the one place an ``LLMEngine`` is made, optionally
warmed up), ``engine_args`` (the benchmark's CPU engine and its KV budget, 8 x 1,000 = 8,000 tokens),
``make_engine`` (one batching mode sized from the shared flags, ``add_engine_args``), and ``drain``."""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from benchmarks.common.flags import positive_int
from benchmarks.common.workloads import (
    BLOCK_SIZE, KV_BUDGET_TOKENS, NUM_KV_BLOCKS, engine_warmup_workload, kv_blocks, request_params,
)


def build_engine(model: str, warm_up: Sequence[int] | None = None, **engine_kwargs: Any):
    """``LLMEngine(model, **engine_kwargs)``; with ``warm_up`` (the model's ordinary token range), warmed up on a few
    requests of every kind first (``warm_up_engine``)."""
    from inflight.engine import LLMEngine

    engine = LLMEngine(str(model), **engine_kwargs)
    if warm_up is not None:
        warm_up_engine(engine, warm_up)
    return engine


def engine_args(batching: str, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                threads: int | None = None, num_kv_blocks: int = NUM_KV_BLOCKS,
                prefill_lane: bool = True, dtype: str = "float32", quantization: str = "none") -> dict[str, Any]:
    """Engine arguments for the benchmark: CPU, ``dtype``, by default the 8,000-token KV budget, and a GGUF file
    dequantized (``quantization="none"``: the model the peers load from its Hugging Face export)."""
    return dict(device="cpu", dtype=dtype, block_size=BLOCK_SIZE, num_kv_blocks=num_kv_blocks,
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, batching=batching,
                num_threads=threads, prefill_lane=prefill_lane, quantization=quantization)


def make_engine(model_path: str, batching: str, args, max_num_seqs: int | None = None, prefill_lane: bool = True,
                speculative_config: dict[str, Any] | None = None):
    """Our engine in one batching mode, warmed up. Unless ``max_num_seqs`` is given, static batching has
    ``--static-batch-size`` slots (8 x 1,000 tokens of KV: the same batch of 8 as transformers' static run)
    and continuous ``--max-num-seqs``; both get the same KV budget. ``prefill_lane``: requests that generate
    nothing take the prefill lane (True) or the scheduler and the paged cache ("mixed")."""
    if max_num_seqs is None:
        max_num_seqs = args.static_batch_size if batching == "static" else args.max_num_seqs
    budget = max(args.max_num_batched_tokens, max_num_seqs)  # the engine needs a token per slot at least
    return build_engine(model_path, warm_up=_token_range_of(model_path),
                        **engine_args(batching, max_num_seqs, budget, args.threads, kv_blocks(args), prefill_lane,
                                      getattr(args, "dtype", "float32"), getattr(args, "quantization", "none")),
                        speculative_config=speculative_config)


def _token_range_of(model_path: str) -> tuple[int, int]:
    from benchmarks.common.models import ordinary_token_range, read_source

    return ordinary_token_range(read_source(str(model_path)))


def drain(engine) -> list:
    """Step ``engine`` until it is idle; return the finished outputs."""
    finished = []
    while engine.has_unfinished_requests():
        finished.extend(o for o in engine.step() if o.finished)
    return finished


def warm_up_engine(engine, token_range: Sequence[int]) -> None:
    for i, request in enumerate(engine_warmup_workload(token_range)):
        engine.add_request(f"warmup-{i}", request.prompt_token_ids, request_params(request))
    drain(engine)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Our engine's size, the same for every system compared."""
    parser.add_argument("--threads", type=positive_int, default=2, help="torch intra-op threads")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="the dtype every system runs in; auto: what our engine picks for the model on this CPU "
                             "(bfloat16 for a half-precision or quantized checkpoint where the CPU has bfloat16 "
                             "instructions and our kernels use them, else float32), resolved once and given to the "
                             "peers too")
    parser.add_argument("--quantization", choices=["none", "auto"], default="none",
                        help="ours on a GGUF file: none (dequantized: the model the peers load, the default) or auto "
                             "(its Q4/Q8 weights kept quantized)")
    parser.add_argument("--max-num-seqs", type=positive_int, default=64,
                        help="batch slots of continuous batching (ours; hf-cb's max_requests_per_batch)")
    parser.add_argument("--static-batch-size", type=positive_int, default=8,
                        help="batch slots of static batching (ours and transformers'): 8 slots x 1,000 tokens of KV")
    parser.add_argument("--kv-budget-tokens", type=positive_int, default=KV_BUDGET_TOKENS,
                        help=f"KV cache size in tokens for every engine, a multiple of {BLOCK_SIZE}")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=2048,
                        help="tokens per step (ours and hf-cb)")
    parser.add_argument("--cache-dir", help="where the benchmark checkpoint is built; None: "
                                            "$INFLIGHT_BENCH_CACHE or ~/.cache/inflight/benchmarks")
