"""Paged attention in plain PyTorch: the CPU path and the oracle the GPU kernels are tested against.

Batched, not a loop per token: every single-token row (decode) is one padded SDPA call over
gathered context; each multi-token row (prefill chunk) is one SDPA call over its cached context
plus the chunk, causal within the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.backend import AttentionBackend, BatchLayout


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]
    decode_token_index: torch.Tensor | None  # [num_decode] positions in the flat token dim
    decode_slots: torch.Tensor | None  # [num_decode, max_seq_len] cache slots to read
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_seq_len] True where a key is visible
    # (token start, token end, cache slots of the row's whole sequence [seq_len], causal mask or None)
    prefill_rows: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]


def _row_slots(block_table: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions [0, seq_len) of one row: [seq_len]."""
    num_blocks = -(-seq_len // block_size)
    offsets = torch.arange(block_size, device=block_table.device)
    return (block_table[:num_blocks, None] * block_size + offsets).reshape(-1)[:seq_len]


class TorchPagedAttention(AttentionBackend):
    name = "torch"

    def prepare(self, layout: BatchLayout) -> TorchAttentionMetadata:
        device = layout.slot_mapping.device
        bs = layout.block_size
        decode_rows, decode_tokens, prefill_rows = [], [], []
        token_start = 0
        for row, (q_len, seq_len) in enumerate(zip(layout.query_lens, layout.seq_lens)):
            if q_len == 1:
                decode_rows.append(row)
                decode_tokens.append(token_start)
            else:
                slots = _row_slots(layout.block_tables[row], seq_len, bs)
                mask = None
                if seq_len != q_len:  # cached context before the chunk: causal with an offset
                    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
                    mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
                prefill_rows.append((token_start, token_start + q_len, slots, mask))
            token_start += q_len

        decode_index = decode_slots = decode_mask = None
        if decode_rows:
            rows = torch.tensor(decode_rows, device=device)
            seq_lens = torch.tensor([layout.seq_lens[r] for r in decode_rows], device=device)
            max_len = int(seq_lens.max())
            num_blocks = -(-max_len // bs)
            tables = layout.block_tables[rows, :num_blocks]  # [num_decode, num_blocks]
            offsets = torch.arange(bs, device=device)
            decode_slots = (tables[:, :, None] * bs + offsets).reshape(len(decode_rows), -1)[:, :max_len]
            positions = torch.arange(max_len, device=device)
            decode_mask = (positions[None, :] < seq_lens[:, None])[:, None, None, :]
            decode_index = torch.tensor(decode_tokens, device=device)
        return TorchAttentionMetadata(layout.slot_mapping, decode_index, decode_slots, decode_mask, prefill_rows)

    def store_kv(self, key, value, k_cache, v_cache, metadata: TorchAttentionMetadata) -> None:
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, key)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, value)

    def forward(self, query, k_cache, v_cache, metadata: TorchAttentionMetadata, scale: float) -> torch.Tensor:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        if metadata.decode_token_index is not None and not metadata.prefill_rows:
            return self._decode(query, k_flat, v_flat, metadata, scale)
        out = torch.empty_like(query)
        if metadata.decode_token_index is not None:
            out[metadata.decode_token_index] = self._decode(query[metadata.decode_token_index], k_flat, v_flat, metadata, scale)
        for start, end, slots, mask in metadata.prefill_rows:
            q = query[start:end].transpose(0, 1)  # [num_heads, q_len, head_dim]
            k = k_flat[slots].transpose(0, 1)  # [num_kv_heads, seq_len, head_dim]
            v = v_flat[slots].transpose(0, 1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                               scale=scale, enable_gqa=True)
            out[start:end] = o.transpose(0, 1)
        return out

    @staticmethod
    def _decode(query, k_flat, v_flat, metadata: TorchAttentionMetadata, scale: float) -> torch.Tensor:
        q = query.unsqueeze(2)  # [num_decode, num_heads, 1, head_dim]
        k = k_flat[metadata.decode_slots].transpose(1, 2)  # [num_decode, num_kv_heads, max_len, head_dim]
        v = v_flat[metadata.decode_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=metadata.decode_mask, scale=scale, enable_gqa=True)
        return o.squeeze(2)
