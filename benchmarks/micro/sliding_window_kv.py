"""The KV a sliding-window model holds on a long prompt: its windowed layers' KV kept apart, only their windows
(engine/block_pool.py), against every layer keeping the whole sequence (what the engine held before, and still holds
under tensor parallelism).

A Gemma 2 layer stack (every other layer slides; 26 layers, 4 KV heads of 256, as Gemma-2-2B), or Gemma 3's (five
layers of six slide, ``--family gemma3``), with dummy weights and a small hidden size (the KV does not depend on it;
the prefill then takes seconds on a CPU), the window scaled to ``--window``. One request of ``--windows`` windows of prompt is prefilled in chunks and decodes ``--decode`` tokens;
after each step the engine's block counts give the bytes held. Also: how many tokens a KV budget of
``--budget-mb`` holds each way (the window caches sized for every slot's window, ``kv_budget.window_blocks_needed``).

    python -m benchmarks.micro.sliding_window_kv --window 1024 --windows 4
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from benchmarks.common.flags import positive_int
from benchmarks.common.report import print_table, write_json
from benchmarks.common.workloads import write_shape

LAYERS, KV_HEADS, HEAD_DIM = 26, 4, 256  # Gemma-2-2B's attention


def write_config(path: Path, family: str, window: int, max_len: int) -> Path:
    config = dict(architectures=["Gemma2ForCausalLM" if family == "gemma2" else "Gemma3ForCausalLM"],
                  hidden_size=256, intermediate_size=512,
                  num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                  hidden_activation="gelu_pytorch_tanh", sliding_window=window, query_pre_attn_scalar=256,
                  attn_logit_softcapping=50.0, final_logit_softcapping=30.0, max_position_embeddings=max_len,
                  rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True)
    if family == "gemma3":
        config.update(attn_logit_softcapping=None, final_logit_softcapping=None, rope_local_base_freq=10000.0,
                      rope_theta=1e6, sliding_window_pattern=6)
    return write_shape(path, config)


def run(family: str, window: int, windows: int, decode: int, chunk: int, budget_mb: int, slots: int) -> dict:
    from inflight.engine import LLMEngine, SamplingParams

    prompt_len = windows * window
    block = 16
    with tempfile.TemporaryDirectory() as tmp:
        path = write_config(Path(tmp) / family, family, window, prompt_len + decode + 1)
        engine = LLMEngine(str(path), load_format="dummy", dtype="float32", block_size=block, max_num_seqs=1,
                           max_num_batched_tokens=chunk, enable_prefix_caching=False, max_model_len=prompt_len + decode + 1)
        runner = engine.runner
        layer_block = runner.kv_layer_block_bytes
        full_layers, window_layers = LAYERS - len(runner.window_layers), len(runner.window_layers)
        engine.add_request("r", list(range(7, 7 + 250)) * (prompt_len // 250) + [7] * (prompt_len % 250),
                           SamplingParams(max_tokens=decode, ignore_eos=True, temperature=0))
        peak_apart = peak_whole = 0
        at_prefill_end = None
        started = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            stats = engine.stats()
            apart = stats["kv_blocks_used"] * full_layers * layer_block + stats["kv_window_blocks_used"] * window_layers * layer_block
            whole = stats["kv_blocks_used"] * LAYERS * layer_block
            peak_apart, peak_whole = max(peak_apart, apart), max(peak_whole, whole)
            request = next(iter(engine.scheduler.requests.values()), None)
            if at_prefill_end is None and request is not None and request.num_computed_tokens >= prompt_len:
                at_prefill_end = (apart, whole, stats["kv_window_blocks_used"], stats["kv_blocks_used"])
        seconds = time.perf_counter() - started
        engine.close()
        # A budget's worth, with the window caches sized for ``slots`` requests' windows, as the engine sizes them
        budget = budget_mb << 20
        tokens_whole = budget // (LAYERS * layer_block) * block
        budgeted = LLMEngine(str(path), load_format="dummy", dtype="float32", block_size=block, max_num_seqs=slots,
                             max_num_batched_tokens=chunk, kv_cache_memory_bytes=budget)
        tokens_apart = budgeted.runner.num_kv_blocks * block
        budgeted.close()
    return {"family": family, "window": window, "prompt_tokens": prompt_len, "decode_tokens": decode, "chunk": chunk, "block_size": block,
            "layers": LAYERS, "window_layers": window_layers, "kv_bytes_per_token_layer": layer_block // block,
            "prefill_end_apart_bytes": at_prefill_end[0], "prefill_end_whole_bytes": at_prefill_end[1],
            "prefill_end_window_blocks": at_prefill_end[2], "prefill_end_table_blocks": at_prefill_end[3],
            "peak_apart_bytes": peak_apart, "peak_whole_bytes": peak_whole, "seconds": seconds,
            "budget_mb": budget_mb, "slots": slots, "budget_tokens_apart": tokens_apart, "budget_tokens_whole": tokens_whole}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=["gemma2", "gemma3"], default="gemma2")
    parser.add_argument("--window", type=positive_int, default=1024)
    parser.add_argument("--windows", type=positive_int, default=4, help="prompt length in windows")
    parser.add_argument("--decode", type=positive_int, default=16)
    parser.add_argument("--chunk", type=positive_int, default=512, help="max_num_batched_tokens")
    parser.add_argument("--budget-mb", type=positive_int, default=1024)
    parser.add_argument("--slots", type=positive_int, default=8, help="max_num_seqs of the budget's engine")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    r = run(args.family, args.window, args.windows, args.decode, args.chunk, args.budget_mb, args.slots)
    mb = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    print_table(f"{r['family']}: KV held on a {r['prompt_tokens']}-token prompt, window {r['window']} ({r['window_layers']} of "
                f"{r['layers']} layers slide), chunks of {r['chunk']}",
                ["", "windows apart MB", "every layer whole MB", "apart / whole"],
                [["end of prefill", mb(r["prefill_end_apart_bytes"]), mb(r["prefill_end_whole_bytes"]),
                  f"{r['prefill_end_apart_bytes'] / r['prefill_end_whole_bytes']:.2f}"],
                 ["peak", mb(r["peak_apart_bytes"]), mb(r["peak_whole_bytes"]),
                  f"{r['peak_apart_bytes'] / r['peak_whole_bytes']:.2f}"],
                 [f"tokens in {r['budget_mb']} MB, {r['slots']} slots", r["budget_tokens_apart"], r["budget_tokens_whole"],
                  f"{r['budget_tokens_apart'] / r['budget_tokens_whole']:.2f}"]])
    write_json(args.json, r)


if __name__ == "__main__":
    main()
