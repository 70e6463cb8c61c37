"""The CPU attention backend (float32): the PyTorch backend with its per-token work in compiled kernels.

Prefill chunks keep ``TorchPagedAttention``'s path: a chunk's context is gathered once and shared by
all its query tokens, so the copy is cheap next to the matmuls that follow. A decode row has a single
query token, and there the gather is the whole cost: ``kernels.cpu_kernels.paged_decode_attention``
reads each row's K and V in place instead (same cache layout). Storing K/V and the model's norms,
RoPE and SiLU-and-mul also run as single-pass kernels (``elementwise_ops``).

The PyTorch decode reads masked slots (weighted by zero), so its ``store_kv`` keeps the cache finite;
nothing here reads a slot past a row's length, so the kernels store K/V as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import cpu_kernels
from kernels.backend import BatchLayout
from kernels.torch_ref import TorchAttentionMetadata, TorchPagedAttention


@dataclass
class CpuAttentionMetadata(TorchAttentionMetadata):
    slot_mapping: torch.Tensor | None = None  # [num_tokens]
    decode_tables: torch.Tensor | None = None  # [num_decode, max_blocks] block tables of the decode rows
    decode_seq_lens: torch.Tensor | None = None  # [num_decode]


class CpuPagedAttention(TorchPagedAttention):
    name = "cpu"

    def elementwise_ops(self):
        return cpu_kernels

    def prepare(self, layout: BatchLayout) -> CpuAttentionMetadata:
        # Without the PyTorch decode's split-KV chunks: only the prefill rows' metadata.
        metadata = CpuAttentionMetadata(**vars(super().prepare(layout, split_decode=False)))
        metadata.slot_mapping = layout.slot_mapping
        decode_rows = [row for row, q_len in enumerate(layout.query_lens) if q_len == 1]
        if decode_rows:
            metadata.decode_tables = layout.block_tables[torch.tensor(decode_rows)]
            metadata.decode_seq_lens = torch.tensor([layout.seq_lens[r] for r in decode_rows], dtype=torch.int64)
        return metadata

    def store_kv(self, key, value, k_cache, v_cache, metadata: CpuAttentionMetadata) -> None:
        cpu_kernels.store_kv(key, value, k_cache, v_cache, metadata.slot_mapping)

    def _decode(self, query, k_cache, v_cache, metadata: CpuAttentionMetadata, scale: float) -> torch.Tensor:
        return cpu_kernels.paged_decode_attention(query, k_cache, v_cache, metadata.decode_tables,
                                                  metadata.decode_seq_lens, scale)
