"""``FlashAttnPagedAttention``: flash-attn 2's paged varlen kernel for attention, our Triton kernel for stores.

One ``flash_attn_varlen_func`` call per layer covers the whole mixed batch (decodes are rows with one
query token): with ``block_table`` it reads K/V straight from the paged cache, and its causal mask is
aligned to the bottom right, which is what a prefill chunk after cached context needs.

flash-attn's paged mode needs blocks of a multiple of 256 tokens (``BLOCK_SIZE_MULTIPLE``); the engine
raises its ``block_size`` to that when this backend is chosen. Its cache layout is
``[num_blocks, block_size, num_kv_heads, head_dim]``; the Triton store kernel takes any layout by strides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inflight.kernels.backend import BatchLayout
from inflight.kernels.triton_backend import TritonPagedAttention

BLOCK_SIZE_MULTIPLE = 256


def flash_attn_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class FlashAttnMetadata:
    slot_mapping: torch.Tensor
    block_size: int
    block_tables: torch.Tensor  # [num_rows, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [num_rows + 1] int32
    cu_seqlens_k: torch.Tensor  # [num_rows + 1] int32
    max_query_len: int
    max_seq_len: int


class FlashAttnPagedAttention(TritonPagedAttention):
    name = "flash_attn"
    windows_and_softcap = True  # (flash-attn >= 2.6 takes both)
    block_size_multiple = BLOCK_SIZE_MULTIPLE

    def __init__(self) -> None:
        super().__init__()
        from flash_attn import flash_attn_varlen_func

        self._varlen = flash_attn_varlen_func

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def prepare(self, layout: BatchLayout) -> FlashAttnMetadata:
        if layout.block_size % BLOCK_SIZE_MULTIPLE:
            raise ValueError(f"block_size must be a multiple of {BLOCK_SIZE_MULTIPLE} for flash-attn's paged KV, "
                             f"got {layout.block_size}")
        device = layout.slot_mapping.device
        cumsum = lambda values: torch.tensor([0, *values], dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)  # noqa: E731
        return FlashAttnMetadata(layout.slot_mapping, layout.block_size, layout.block_tables.to(torch.int32),
                                 cumsum(layout.query_lens), cumsum(layout.seq_lens), max(layout.query_lens),
                                 max(layout.seq_lens))

    @staticmethod
    def cache_strides(cache: torch.Tensor) -> tuple[int, int, int]:
        # [num_blocks, block_size, num_kv_heads, head_dim]: the inherited Triton store reads it by these strides
        return cache.stride(0), cache.stride(2), cache.stride(1)

    def forward(self, query, key, value, k_cache, v_cache, metadata: FlashAttnMetadata, scale: float,
                out: torch.Tensor | None = None, *, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        # flash-attn's window counts keys before the query (window - 1 of ours) and after it (none, causal)
        result = self._varlen(query, k_cache, v_cache, metadata.cu_seqlens_q, metadata.cu_seqlens_k,
                              metadata.max_query_len, metadata.max_seq_len, softmax_scale=scale, causal=True,
                              window_size=(window - 1, 0) if window is not None else (-1, -1),
                              softcap=softcap or 0.0, block_table=metadata.block_tables)
        if out is not None:
            out.copy_(result)
            return out
        return result
