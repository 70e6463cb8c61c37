"""Causal attention over whole prompts with no KV cache: the prefill-only lane's attention.

A lane batch (``engine/prefill_lane.py``) is a set of complete prompts that produce no token, so
nothing they compute is ever read again: their K/V need no home in the paged cache. Each prompt
attends to itself only, causally, through the backend's ``prompt_attention`` (by default
``scaled_dot_product_attention``: flash or memory-efficient kernels on CUDA, a fused kernel on the CPU; the CPU
backend's own causal kernel). Every backend uses this path for such steps, which is why it lives apart from
them: a backend knows the paged cache, this knows none. ``causal_tiles`` is the attention arithmetic itself, in
tiles of query rows, with sliding windows and soft-capped scores: SDPA has no soft-capping, and the paged PyTorch
backend attends a chunk after cached context through it too.
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


QUERY_TILE = 256  # query rows per tile of ``causal_tiles``


def causal_tiles(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int, scale: float,
                 causal_tile: torch.Tensor | None = None, window: int | None = None,
                 softcap: float | None = None) -> torch.Tensor:
    """q [num_kv_heads, group, q_len, head_dim] at key positions num_cached.., k/v [num_kv_heads, keys, head_dim].

    Tile by tile of query rows: a tile's scores reach only up to its own last key, so no work goes to the masked upper
    triangle; keys before the tile are all visible, keys inside it causally (``causal_tile``: the [tile, tile]
    additive mask, -inf above the diagonal, made once a step by the caller). A ``window`` hides keys more than
    ``window - 1`` positions before the query (and the tile skips keys before its first query's window);
    ``softcap`` caps the scores first.
    """
    if causal_tile is None:
        tile = min(QUERY_TILE, q.shape[2])
        causal_tile = torch.full((tile, tile), float("-inf"), device=q.device).triu(1)
    q = q * scale
    q_len, tile = q.shape[2], causal_tile.shape[0]
    k_t = k[:, None].transpose(-1, -2)  # [num_kv_heads, 1, head_dim, keys]
    v = v[:, None]
    out = torch.empty_like(q)
    for start in range(0, q_len, tile):
        end = min(q_len, start + tile)
        last_key = num_cached + end
        first_key = 0 if window is None else max(0, num_cached + start + 1 - window)
        scores = torch.matmul(q[:, :, start:end], k_t[..., first_key:last_key])  # [kv_heads, group, tile, keys]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores[..., num_cached + start - first_key:] += causal_tile[:end - start, :end - start]
        if window is not None:  # key j is hidden from query i where j <= i - window
            query_pos = torch.arange(num_cached + start, num_cached + end, device=q.device)[:, None]
            key_pos = torch.arange(first_key, last_key, device=q.device)[None, :]
            scores.masked_fill_(key_pos <= query_pos - window, float("-inf"))
        out[:, :, start:end] = torch.matmul(torch.softmax(scores, dim=-1), v[:, :, first_key:last_key])
    return out


def sdpa_prompt_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, *,
                          window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """One whole prompt attending to itself, causally, through SDPA: query [tokens, heads, head_dim], key/value
    [tokens, kv_heads, head_dim] -> like query. With a window or soft-capping: ``causal_tiles``."""
    if window is not None or softcap is not None:
        num_kv_heads = key.shape[1]
        q = query.transpose(0, 1).reshape(num_kv_heads, query.shape[1] // num_kv_heads, query.shape[0], -1)
        o = causal_tiles(q, key.transpose(0, 1), value.transpose(0, 1), 0, scale, None, window, softcap)
        return o.reshape(query.shape[1], query.shape[0], -1).transpose(0, 1)
    q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))  # [1, heads, length, head_dim]: SDPA's layout
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=query.shape[1] != key.shape[1])
    return o[0].transpose(0, 1)


PromptAttention = Callable[..., torch.Tensor]  # (query, key, value, scale, *, window, softcap) -> like query


def dense_prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            metadata: DensePrefillMetadata, scale: float,
                            attend: PromptAttention = sdpa_prompt_attention, *, window: int | None = None,
                            softcap: float | None = None) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim], key/value [num_tokens, num_kv_heads, head_dim] -> like query.

    One ``attend`` call per prompt (varlen without padding: no work on pad rows, no mask tensor): SDPA, or the
    backend's ``prompt_attention`` (the model passes it: the CPU backend's causal kernel is 2-10x SDPA there).
    Prompts of a lane batch are few and long, so the per-call overhead is small next to each call's work.
    """
    out = torch.empty_like(query)
    start = 0
    for length in metadata.query_lens:
        end = start + length
        out[start:end] = attend(query[start:end], key[start:end], value[start:end], scale, window=window,
                                softcap=softcap)
        start = end
    return out
