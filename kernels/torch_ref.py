"""Paged attention in plain PyTorch: the CPU path and the oracle the GPU kernels are tested against.

Batched, not a loop per token. All single-token rows (decodes) go through batched matmuls over
their gathered context. A prefill chunk with nothing cached before it attends to itself through the
backend's ``prompt_attention`` (here ``scaled_dot_product_attention``, ``kernels.dense_prefill``; torch 2.13's
fused CPU kernel: 7.3 ms against 23 ms for the tiles below at 800 tokens, 8 heads of 32, on the 2-core
benchmark machine). A chunk after cached context attends to that context plus itself, causal within the chunk,
a tile of query rows at a time: a tile's scores only reach up to its own last position, so no work goes to the
masked upper triangle and the scores stay small enough to live in cache (SDPA's causal mask is aligned to the
first key, not the last, so it cannot serve these rows).

The cache layout is head-major, ``[num_kv_heads, num_blocks + 1, block_size, head_dim]``, so context
is gathered as whole (head, block) slabs of block_size x head_dim contiguous values (one
``index_select`` on a flat view) and lands as ``[num_kv_heads, num_requests, context, head_dim]``:
already the batch of matrices the decode matmuls want. The KV bytes are copied once, not three
times, and on a CPU decode attention is bound by exactly those bytes.

A sliding-window layer (``window``) reads only its rows' last ``window`` positions: decode chunks start at the
window's first block, a prefill tile gathers keys from its first query's window on. Soft-capped scores
(``softcap``: ``cap * tanh(score / cap)``) are capped before the mask, as transformers does.

Masked slots (a block's unused tail, block-table padding) are read but weighted by an exact zero.
That is only harmless if they hold finite values, so ``store_kv`` never writes inf or NaN: a
request whose activations overflow gets garbage, but it cannot poison another request's output.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from inflight.kernels.backend import AttentionBackend, BatchLayout
from inflight.kernels.dense_prefill import QUERY_TILE, causal_tiles


DECODE_CHUNK_TOKENS = 128  # context tokens per split-KV chunk of decode attention
# A chunk of at most this many tokens after a longer cached context is attended as that many decode queries.
MAX_DECODE_QUERIES = 16


@dataclass
class PrefillRow:
    token_start: int
    token_end: int
    seq_len: int
    blocks: torch.Tensor | None  # [num_blocks] holding the row's context; None: no cached context


@dataclass
class DecodeSplit:
    """The decode rows' context cut into split-KV chunks (see ``_split_context``), for one window."""

    blocks: torch.Tensor  # [num_chunks * chunk_blocks] block ids to gather, chunk-major
    hidden: torch.Tensor  # [1, num_chunks, 1, chunk_blocks * block_size] True where NOT visible
    chunk_row: torch.Tensor  # [num_chunks] which decode row each context chunk belongs to
    slabs: torch.Tensor | None = None  # blocks for every kv head, into the flat cache view (made on first use)


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V goes: block * block_size + offset
    block_size: int
    all_decode: bool
    prefill_rows: list[PrefillRow]
    causal_tile: torch.Tensor | None  # [tile, tile] additive mask: -inf above the diagonal (None: no prefill rows)
    decode_token_index: torch.Tensor | None = None  # [num_decode] positions of decode rows in the flat token dim
    decode_tables: torch.Tensor | None = None  # [num_decode, max_blocks] the decode rows' block tables
    decode_seq_lens: torch.Tensor | None = None  # [num_decode] int64 keys each decode row sees
    # TorchPagedAttention's own decode: the split-KV chunks by window (None: the whole context), made once a step
    decode_splits: dict[int | None, DecodeSplit] = dataclasses.field(default_factory=dict)

    def decode_split(self, window: int | None) -> DecodeSplit:
        split = self.decode_splits.get(window)
        if split is None:
            split = self.decode_splits[window] = DecodeSplit(*_split_context(
                self.decode_tables, self.decode_seq_lens, self.block_size, window))
        return split

    # Made on first use, once per step: only the PyTorch store_kv reads them (the CPU kernel takes the slots).
    @functools.cached_property
    def slot_blocks(self) -> torch.Tensor:  # [num_tokens] block each new token's K/V goes to
        return self.slot_mapping // self.block_size

    @functools.cached_property
    def slot_offsets(self) -> torch.Tensor:  # [num_tokens] its offset inside that block
        return self.slot_mapping % self.block_size


class TorchPagedAttention(AttentionBackend):
    name = "torch"
    windows_and_softcap = True
    block_dim = 1  # head-major layout, see the module docstring

    def prepare(self, layout: BatchLayout) -> TorchAttentionMetadata:
        device = layout.slot_mapping.device
        bs = layout.block_size
        decode_rows, decode_tokens, decode_lens, prefill_rows = [], [], [], []
        token_start = 0
        for row, (q_len, seq_len) in enumerate(zip(layout.query_lens, layout.seq_lens)):
            if q_len == 1:
                decode_rows.append(row)
                decode_tokens.append(token_start)
                decode_lens.append(seq_len)
            elif q_len <= MAX_DECODE_QUERIES < seq_len:
                # A short chunk after a long cached context (a decode row with speculative tokens to verify):
                # each of its tokens is a decode query over the same block table that sees one more key than
                # the one before (the chunk's own K/V is stored before attention), so the decode kernel takes
                # them, with no per-row gather and no tile loop.
                decode_rows.extend([row] * q_len)
                decode_tokens.extend(range(token_start, token_start + q_len))
                decode_lens.extend(range(seq_len - q_len + 1, seq_len + 1))
            elif seq_len == q_len:  # nothing cached before this chunk: attend to the chunk itself
                prefill_rows.append(PrefillRow(token_start, token_start + q_len, seq_len, None))
            else:
                blocks = layout.block_tables[row, :-(-seq_len // bs)]
                prefill_rows.append(PrefillRow(token_start, token_start + q_len, seq_len, blocks))
            token_start += q_len

        causal_tile = None
        if prefill_rows:
            tile = min(QUERY_TILE, max(r.token_end - r.token_start for r in prefill_rows))
            causal_tile = torch.full((tile, tile), float("-inf"), device=device).triu(1)
        metadata = TorchAttentionMetadata(layout.slot_mapping, bs, all_decode=not prefill_rows,
                                          prefill_rows=prefill_rows, causal_tile=causal_tile)
        if decode_rows:
            if not prefill_rows and len(decode_rows) == len(layout.query_lens):  # every row one decode token
                metadata.decode_tables = layout.block_tables
            else:
                metadata.decode_token_index = torch.tensor(decode_tokens, device=device)
                metadata.decode_tables = layout.block_tables[torch.tensor(decode_rows, device=device)]
            metadata.decode_seq_lens = torch.tensor(decode_lens, dtype=torch.int64, device=device)
        return metadata

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_kv_heads, num_blocks, block_size, head_dim)

    def store_kv(self, key, value, k_cache, v_cache, metadata: TorchAttentionMetadata) -> None:
        blocks, offsets = metadata.slot_blocks, metadata.slot_offsets
        k_cache[:, blocks, offsets] = torch.nan_to_num(key).transpose(0, 1)  # key: [num_tokens, num_kv_heads, head_dim]
        v_cache[:, blocks, offsets] = torch.nan_to_num(value).transpose(0, 1)

    def forward(self, query, key, value, k_cache, v_cache, metadata: TorchAttentionMetadata, scale: float, *,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        if metadata.all_decode:
            return self._decode(query, k_cache, v_cache, metadata, scale, window, softcap)
        out = torch.empty_like(query)
        if metadata.decode_token_index is not None:
            index = metadata.decode_token_index
            out[index] = self._decode(query[index], k_cache, v_cache, metadata, scale, window, softcap)
        num_heads, num_kv_heads = query.shape[1], k_cache.shape[0]
        for row in metadata.prefill_rows:
            q_len = row.token_end - row.token_start
            if row.blocks is None:  # nothing cached before the chunk: it attends to itself only
                rows = slice(row.token_start, row.token_end)
                out[rows] = self.prompt_attention(query[rows], key[rows], value[rows], scale, window=window,
                                                  softcap=softcap)
                continue
            # Keys from the first query's window on (whole blocks): those before it are out of every query's
            first_key = 0 if window is None else max(0, row.seq_len - q_len + 1 - window) // metadata.block_size
            first_key *= metadata.block_size
            q = query[row.token_start:row.token_end].transpose(0, 1)  # [num_heads, q_len, head_dim]
            k = _gather_context(k_cache, row.blocks, row.seq_len, first_key)  # [num_kv_heads, keys, head_dim]
            v = _gather_context(v_cache, row.blocks, row.seq_len, first_key)
            q = q.reshape(num_kv_heads, num_heads // num_kv_heads, q_len, -1)  # query heads grouped by kv head
            if q.dtype != torch.float32 and q.device.type == "cpu":
                # In float32, as the CPU kernels attend (a fresh prompt's, a decode row's): bf16 matmuls round each
                # score to bf16, and a prompt found in the prefix cache then got another first token than the same
                # prompt computed whole, at a near-tie (the real model asked for France's capital).
                q, k, v = q.float(), k.float(), v.float()
            o = causal_tiles(q, k, v, row.seq_len - q_len - first_key, scale, metadata.causal_tile, window, softcap)
            out[row.token_start:row.token_end] = o.reshape(num_heads, q_len, -1).transpose(0, 1).to(out.dtype)
        return out

    def _decode(self, query, k_cache, v_cache, metadata: TorchAttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """Split-KV decode (flash-decoding): each row's context (its last ``window`` positions, if a window) is
        cut into fixed-size chunks, every chunk is attended to on its own (one batch of matmuls for all chunks of
        all rows, no padding to the longest row), then each row's chunks are merged with their softmax
        statistics."""
        num_decode, num_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[0]
        group = num_heads // num_kv_heads
        split = metadata.decode_split(window)
        if split.slabs is None:  # the same for every layer: computed once per step
            split.slabs = _slab_index(split.blocks, k_cache)
        chunk_row = split.chunk_row
        num_chunks = chunk_row.shape[0]
        # [num_kv_heads, num_chunks, chunk_len, head_dim]: one gather, no further copies
        k = _flat(k_cache).index_select(0, split.slabs).view(num_kv_heads, num_chunks, -1, head_dim)
        v = _flat(v_cache).index_select(0, split.slabs).view(num_kv_heads, num_chunks, -1, head_dim)
        q = (query * scale).view(num_decode, num_kv_heads, group, head_dim)[chunk_row].transpose(0, 1)
        scores = torch.matmul(q, k.transpose(-1, -2))  # [num_kv_heads, num_chunks, group, chunk_len]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores.masked_fill_(split.hidden, float("-inf"))
        if num_chunks == num_decode:  # one chunk per row: a plain softmax
            probs = torch.softmax(scores, dim=-1)
            return torch.matmul(probs, v).transpose(0, 1).reshape(num_decode, num_heads, head_dim)
        chunk_max = scores.amax(dim=-1, keepdim=True)  # finite: every chunk holds a visible key
        probs = torch.exp(scores - chunk_max)
        chunk_sum = probs.sum(dim=-1, keepdim=True)  # [num_kv_heads, num_chunks, group, 1]
        chunk_out = torch.matmul(probs, v)  # [num_kv_heads, num_chunks, group, head_dim]
        index = chunk_row.view(1, -1, 1, 1).expand_as(chunk_max)
        row_max = torch.full((num_kv_heads, num_decode, group, 1), float("-inf"), dtype=scores.dtype,
                             device=scores.device).scatter_reduce_(1, index, chunk_max, "amax")
        weight = torch.exp(chunk_max - row_max[:, chunk_row])
        total = torch.zeros_like(row_max).index_add_(1, chunk_row, chunk_sum * weight)
        out = torch.zeros((num_kv_heads, num_decode, group, head_dim), dtype=chunk_out.dtype,
                          device=chunk_out.device).index_add_(1, chunk_row, chunk_out * weight)
        return (out / total).transpose(0, 1).reshape(num_decode, num_heads, head_dim)


def _split_context(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, window: int | None = None):
    """Cut each row's context (its last ``window`` positions, from that window's first block) into chunks of
    ``DECODE_CHUNK_TOKENS``: every chunk then holds a visible key.

    Returns the chunks' block ids [num_chunks * chunk_blocks], their hidden mask
    [1, num_chunks, 1, chunk_blocks * block_size] and the row of each chunk [num_chunks].
    """
    device = seq_lens.device
    chunk_blocks = max(1, DECODE_CHUNK_TOKENS // block_size)
    chunk_tokens = chunk_blocks * block_size
    first_visible = (seq_lens - window).clamp(min=0) if window is not None else torch.zeros_like(seq_lens)
    first_block = first_visible // block_size  # [num_rows] the table column chunk 0 starts at
    skipped = first_block * block_size
    num_chunks = (seq_lens - skipped + chunk_tokens - 1) // chunk_tokens  # [num_rows]
    chunk_row = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), num_chunks)
    first_chunk = torch.cumsum(num_chunks, 0) - num_chunks
    chunk_index = torch.arange(len(chunk_row), device=device) - first_chunk[chunk_row]  # chunk number within its row
    columns = (first_block[chunk_row, None] + chunk_index[:, None] * chunk_blocks
               + torch.arange(chunk_blocks, device=device))  # [num_chunks, chunk_blocks]
    padded = torch.nn.functional.pad(block_tables, (0, chunk_blocks))  # columns past a table read block 0: masked
    blocks = padded[chunk_row[:, None], columns].reshape(-1)
    positions = skipped[chunk_row, None] + chunk_index[:, None] * chunk_tokens + torch.arange(chunk_tokens, device=device)
    hidden = (positions >= seq_lens[chunk_row][:, None]) | (positions < first_visible[chunk_row][:, None])
    return blocks, hidden[None, :, None, :], chunk_row


def _flat(cache: torch.Tensor) -> torch.Tensor:
    """[num_kv_heads * num_blocks, block_size * head_dim]: one row per contiguous (head, block) slab."""
    return cache.view(cache.shape[0] * cache.shape[1], -1)


def _slab_index(blocks: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rows of ``_flat(cache)`` holding ``blocks`` for every kv head, head-major: [num_kv_heads * len(blocks)]."""
    num_kv_heads, num_blocks = cache.shape[0], cache.shape[1]
    heads = torch.arange(num_kv_heads, device=blocks.device)[:, None] * num_blocks
    return (heads + blocks[None, :]).reshape(-1)


def _gather_context(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int, first: int = 0) -> torch.Tensor:
    """One row's cached tokens ``first`` (a multiple of the block size) to ``seq_len`` as [num_kv_heads, seq_len -
    first, head_dim]."""
    blocks = blocks[first // cache.shape[2]:]
    gathered = _flat(cache).index_select(0, _slab_index(blocks, cache))
    return gathered.view(cache.shape[0], -1, cache.shape[3])[:, :seq_len - first]
