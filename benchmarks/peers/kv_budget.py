"""How vLLM is sized to our KV budget, shared by our process (``benchmarks.peers.vllm_baseline``) and the scripts
that run under vLLM's Python (``vllm_offline.py``, ``vllm_serve.py``). Standard library only."""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
_THREADS_BIND = re.compile(r"auto|nobind|[0-9][0-9,\-|]*")


def kv_cache_sizes(kv_budget_tokens: int, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                   dtype_bytes: int) -> tuple[int, int]:
    """(num_gpu_blocks_override, kv_cache_memory_bytes) for ``kv_budget_tokens`` of KV: vLLM holds one block
    back, so it gets one more block than the budget needs, and exactly those blocks' bytes (K and V)."""
    num_blocks = math.ceil(kv_budget_tokens / block_size) + 1
    bytes_per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes
    return num_blocks, num_blocks * bytes_per_block


def checkpoint_kv_shape(model_path: str | Path) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a checkpoint, from its config.json."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    num_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
    return config["num_hidden_layers"], config.get("num_key_value_heads", num_heads), head_dim


def threads_bind(text: str) -> str:
    """An argparse type for ``VLLM_CPU_OMP_THREADS_BIND``: a CPU list like ``0-1`` or ``0,2``, or ``auto``."""
    if not _THREADS_BIND.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected a CPU list like 0-1 or 0,2, or auto, got {text!r}")
    return text
