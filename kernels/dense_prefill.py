"""Causal attention over whole prompts with no KV cache: the prefill-only lane's attention.

A lane batch (``engine/prefill_lane.py``) is a set of complete prompts that produce no token, so
nothing they compute is ever read again: their K/V need no home in the paged cache. Each prompt
attends to itself only, causally, through the backend's ``prompt_attention`` (by default
``scaled_dot_product_attention``: flash or memory-efficient kernels on CUDA, a fused kernel on the CPU; the CPU
backend's own causal kernel). Every backend uses this path for such steps, which is why it lives apart from
them: a backend knows the paged cache, this knows none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DensePrefillMetadata:
    """The flat batch is ``len(query_lens)`` whole prompts, in order, each starting at position 0."""

    query_lens: list[int]


def sdpa_prompt_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """One whole prompt attending to itself, causally, through SDPA: query [tokens, heads, head_dim], key/value
    [tokens, kv_heads, head_dim] -> like query."""
    q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))  # [1, heads, length, head_dim]: SDPA's layout
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=query.shape[1] != key.shape[1])
    return o[0].transpose(0, 1)


PromptAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def dense_prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            metadata: DensePrefillMetadata, scale: float,
                            attend: PromptAttention = sdpa_prompt_attention) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim], key/value [num_tokens, num_kv_heads, head_dim] -> like query.

    One ``attend`` call per prompt (varlen without padding: no work on pad rows, no mask tensor): SDPA, or the
    backend's ``prompt_attention`` (the model passes it: the CPU backend's causal kernel is 2-10x SDPA there).
    Prompts of a lane batch are few and long, so the per-call overhead is small next to each call's work.
    """
    out = torch.empty_like(query)
    start = 0
    for length in metadata.query_lens:
        end = start + length
        out[start:end] = attend(query[start:end], key[start:end], value[start:end], scale)
        start = end
    return out
