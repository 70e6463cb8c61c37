"""Causal attention over whole prompts with no KV cache: the prefill-only lane's attention.

A lane batch (``engine/prefill_lane.py``) is a set of complete prompts that produce no token, so
nothing they compute is ever read again: their K/V need no home in the paged cache. Each prompt
attends to itself only, causally, with ``scaled_dot_product_attention`` (flash or memory-efficient
kernels on CUDA, a fused kernel on the CPU). Every backend uses this path for such steps, which is
why it lives apart from them: a backend knows the paged cache, this knows none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DensePrefillMetadata:
    """The flat batch is ``len(query_lens)`` whole prompts, in order, each starting at position 0."""

    query_lens: list[int]


def dense_prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            metadata: DensePrefillMetadata, scale: float) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim], key/value [num_tokens, num_kv_heads, head_dim] -> like query.

    One SDPA call per prompt (varlen without padding: no work on pad rows, no mask tensor). Prompts of a
    lane batch are few and long, so the per-call overhead is small next to each call's work.
    """
    gqa = query.shape[1] != key.shape[1]
    out = torch.empty_like(query)
    start = 0
    for length in metadata.query_lens:
        end = start + length
        # [1, heads, length, head_dim]: SDPA's layout
        q, k, v = (t[start:end].transpose(0, 1)[None] for t in (query, key, value))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        out[start:end] = o[0].transpose(0, 1)
        start = end
    return out
