"""Paged attention in plain PyTorch: the CPU path and the oracle the GPU kernels are tested against.

Batched, not a loop per token. All single-token rows (decodes) go through batched matmuls over
their gathered context; each multi-token row (a prefill chunk) is one SDPA call over its cached
context plus the chunk, causal within the chunk.

The cache layout is head-major, ``[num_kv_heads, num_blocks + 1, block_size, head_dim]``, so context
is gathered a whole block at a time (one ``index_select`` on dim 1) and lands as
``[num_kv_heads, num_requests, context, head_dim]``: already the batch of matrices the decode
matmuls want. The KV bytes are copied once, not three times, and on a CPU decode attention is
bound by exactly those bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.backend import AttentionBackend, BatchLayout


@dataclass
class PrefillRow:
    token_start: int
    token_end: int
    seq_len: int
    blocks: torch.Tensor | None  # [num_blocks] holding the row's context; None: no cached context
    mask: torch.Tensor | None  # [query_len, seq_len] visibility when there is cached context


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]
    decode_token_index: torch.Tensor | None  # [num_decode] positions of decode rows in the flat token dim
    decode_blocks: torch.Tensor | None  # [num_decode * max_blocks] block ids to gather, row-major
    decode_hidden: torch.Tensor | None  # [1, num_decode, 1, max_blocks * block_size] True where a key is NOT visible
    all_decode: bool
    prefill_rows: list[PrefillRow]


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
            elif seq_len == q_len:  # nothing cached before this chunk: attend to the chunk itself
                prefill_rows.append(PrefillRow(token_start, token_start + q_len, seq_len, None, None))
            else:
                q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
                mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
                blocks = layout.block_tables[row, :-(-seq_len // bs)]
                prefill_rows.append(PrefillRow(token_start, token_start + q_len, seq_len, blocks, mask))
            token_start += q_len

        decode_index = decode_blocks = decode_hidden = None
        if decode_rows:
            seq_lens = torch.tensor([layout.seq_lens[r] for r in decode_rows], device=device)
            max_blocks = -(-int(seq_lens.max()) // bs)
            rows = torch.tensor(decode_rows, device=device)
            decode_blocks = layout.block_tables[rows, :max_blocks].reshape(-1)
            positions = torch.arange(max_blocks * bs, device=device)
            decode_hidden = (positions[None, :] >= seq_lens[:, None])[None, :, None, :]
            decode_index = torch.tensor(decode_tokens, device=device)
        return TorchAttentionMetadata(layout.slot_mapping, decode_index, decode_blocks, decode_hidden,
                                      not prefill_rows, prefill_rows)

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_kv_heads, num_blocks, block_size, head_dim)

    def store_kv(self, key, value, k_cache, v_cache, metadata: TorchAttentionMetadata) -> None:
        block_size = k_cache.shape[2]
        blocks, offsets = metadata.slot_mapping // block_size, metadata.slot_mapping % block_size
        k_cache[:, blocks, offsets] = key.transpose(0, 1)  # key: [num_tokens, num_kv_heads, head_dim]
        v_cache[:, blocks, offsets] = value.transpose(0, 1)

    def forward(self, query, key, value, k_cache, v_cache, metadata: TorchAttentionMetadata,
                scale: float) -> torch.Tensor:
        if metadata.all_decode:
            return self._decode(query, k_cache, v_cache, metadata, scale)
        out = torch.empty_like(query)
        if metadata.decode_token_index is not None:
            index = metadata.decode_token_index
            out[index] = self._decode(query[index], k_cache, v_cache, metadata, scale)
        for row in metadata.prefill_rows:
            q = query[row.token_start:row.token_end].transpose(0, 1)  # [num_heads, q_len, head_dim]
            if row.blocks is None:
                k = key[row.token_start:row.token_end].transpose(0, 1)  # [num_kv_heads, q_len, head_dim]
                v = value[row.token_start:row.token_end].transpose(0, 1)
            else:
                k = _gather_context(k_cache, row.blocks, row.seq_len)  # [num_kv_heads, seq_len, head_dim]
                v = _gather_context(v_cache, row.blocks, row.seq_len)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=row.mask,
                                               is_causal=row.mask is None, scale=scale, enable_gqa=True)
            out[row.token_start:row.token_end] = o.transpose(0, 1)
        return out

    @staticmethod
    def _decode(query, k_cache, v_cache, metadata: TorchAttentionMetadata, scale: float) -> torch.Tensor:
        num_decode, num_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[0]
        group = num_heads // num_kv_heads
        # [num_kv_heads, num_decode, context, head_dim]: one gather, no further copies
        k = k_cache.index_select(1, metadata.decode_blocks).view(num_kv_heads, num_decode, -1, head_dim)
        v = v_cache.index_select(1, metadata.decode_blocks).view(num_kv_heads, num_decode, -1, head_dim)
        q = query.view(num_decode, num_kv_heads, group, head_dim).transpose(0, 1)  # [num_kv_heads, num_decode, group, head_dim]
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [num_kv_heads, num_decode, group, context]
        scores = scores.masked_fill(metadata.decode_hidden, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        # Masked slots (a block's unused tail, table padding) may hold stale values, even inf after an
        # overflow; a zero probability times inf is NaN, so clear them in the gathered copy.
        v.masked_fill_(metadata.decode_hidden.transpose(-1, -2), 0.0)
        out = torch.matmul(probs, v)  # [num_kv_heads, num_decode, group, head_dim]
        return out.transpose(0, 1).reshape(num_decode, num_heads, head_dim)


def _gather_context(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` cached tokens of one row as [num_kv_heads, seq_len, head_dim]."""
    gathered = cache.index_select(1, blocks)  # [num_kv_heads, num_blocks, block_size, head_dim]
    return gathered.view(gathered.shape[0], -1, gathered.shape[3])[:, :seq_len]
