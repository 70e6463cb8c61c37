"""Triton kernels for the paged KV cache: store, decode attention (split-KV) and prefill attention.

The cache layout is ``[num_blocks, num_kv_heads, block_size, head_dim]``: one (block, head) pair is a
contiguous ``block_size x head_dim`` slab. Token ``pos`` of a row lives in block
``block_table[pos // block_size]`` at offset ``pos % block_size``; the kernels gather keys position
by position through the block table, so any power-of-two block size works and a tile of keys may
span several blocks.

Positions a row cannot see (past its length, or after the query under causality) are loaded as
zeros and scored as -inf, so whatever an unused slot holds never reaches the output.

Softmax runs in base 2 (``exp2``, scores pre-multiplied by log2(e)), the usual trick that saves a
multiply per score; log-sum-exps passed between kernels are in base 2 too.

Under ``TRITON_INTERPRET=1`` these same kernels run on the CPU (numpy), which is how the tests check
them without a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                    stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_cb, stride_ch, stride_cs,
                    block_size, num_kv_heads, head_dim,
                    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
    """One program per new token: copy its K and V (all kv heads) into its cache slot."""
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    cache_offsets = block * stride_cb + heads * stride_ch + offset * stride_cs + dims
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(k_cache_ptr + cache_offsets, k, mask=mask)
    tl.store(v_cache_ptr + cache_offsets, v, mask=mask)


@triton.jit
def _load_paged_kv(k_cache_ptr, v_cache_ptr, table, pos, in_row, kv_head, dims, dim_mask, block_size,
                   stride_cb, stride_ch, stride_cs):
    """K and V [len(pos), DIM_PAD] of one kv head at positions ``pos`` of a row, through its block table;
    positions outside ``in_row`` load as zeros."""
    block = tl.load(table + pos // block_size, mask=in_row, other=0).to(tl.int64)
    slot = block * stride_cb + kv_head * stride_ch + (pos % block_size) * stride_cs
    kv_mask = in_row[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _online_softmax_step(q, k, v, visible, m, lsum, acc, qk_scale, PRECISION: tl.constexpr):
    """Fold one tile of keys into the running max ``m``, sum ``lsum`` and output ``acc`` (flash attention)."""
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    lsum = lsum * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, lsum, acc


@triton.jit
def decode_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, token_index_ptr,
                            out_ptr, partial_out_ptr, partial_lse_ptr,
                            stride_qt, stride_qh, stride_ot, stride_oh,
                            stride_cb, stride_ch, stride_cs, stride_bt,
                            stride_pr, stride_ph, stride_ps, stride_lr, stride_lh,
                            qk_scale, block_size, head_dim, split_len_ptr,
                            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
                            BLOCK_N: tl.constexpr, ONE_SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (decode rows, kv heads, splits). A program attends the GROUP query heads that share one kv
    head (so each K/V element is read once for all of them) to one split of the row's context.

    With ONE_SPLIT it writes the normalised output; otherwise the split's normalised partial output
    and its log-sum-exp, which ``merge_splits_kernel`` combines. ``split_len`` is read from the device,
    so a captured CUDA graph replays correctly whatever the batch's context lengths."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + row)
    split_len = tl.load(split_len_ptr)
    start = split * split_len
    if start < seq_len:
        end = tl.minimum(seq_len, start + split_len)
        token = tl.load(token_index_ptr + row).to(tl.int64)
        group = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, DIM_PAD)
        heads = kv_head * GROUP + group
        head_mask = group < GROUP
        dim_mask = dims < head_dim
        q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                    mask=head_mask[:, None] & dim_mask[None, :], other=0.0)
        acc = tl.zeros((GROUP_PAD, DIM_PAD), dtype=tl.float32)
        m = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
        lsum = tl.zeros((GROUP_PAD,), dtype=tl.float32)
        table = block_tables_ptr + row.to(tl.int64) * stride_bt
        for key_start in range(start, end, BLOCK_N):
            pos = key_start + tl.arange(0, BLOCK_N)
            visible = pos < end
            k, v = _load_paged_kv(k_cache_ptr, v_cache_ptr, table, pos, visible, kv_head, dims, dim_mask, block_size,
                                  stride_cb, stride_ch, stride_cs)
            m, lsum, acc = _online_softmax_step(q, k, v, visible[None, :], m, lsum, acc, qk_scale, PRECISION)
        out = acc / lsum[:, None]
        out_mask = head_mask[:, None] & dim_mask[None, :]
        if ONE_SPLIT:
            tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            partial = partial_out_ptr + row.to(tl.int64) * stride_pr + split * stride_ps
            tl.store(partial + heads[:, None] * stride_ph + dims[None, :], out, mask=out_mask)
            tl.store(partial_lse_ptr + row.to(tl.int64) * stride_lr + heads * stride_lh + split, m + tl.log2(lsum),
                     mask=head_mask)


@triton.jit
def merge_splits_kernel(partial_out_ptr, partial_lse_ptr, seq_lens_ptr, token_index_ptr, out_ptr,
                        stride_pr, stride_ph, stride_ps, stride_lr, stride_lh, stride_ot, stride_oh,
                        head_dim, split_len_ptr,
                        SPLITS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
    """Grid (decode rows, query heads): weight each split's output by exp2(its lse - the max lse)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + row)
    num_splits = tl.cdiv(seq_len, tl.load(split_len_ptr))  # splits past the row's length wrote nothing
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, DIM_PAD)
    used = splits < num_splits
    lse = tl.load(partial_lse_ptr + row.to(tl.int64) * stride_lr + head * stride_lh + splits, mask=used,
                  other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, axis=0))
    weight = tl.where(used, weight, 0.0)
    partial = tl.load(partial_out_ptr + row.to(tl.int64) * stride_pr + head * stride_ph
                      + splits[:, None] * stride_ps + dims[None, :],
                      mask=used[:, None] & (dims[None, :] < head_dim), other=0.0)
    out = tl.sum(partial * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    token = tl.load(token_index_ptr + row).to(tl.int64)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < head_dim)


@triton.jit
def prefill_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
                             query_lens_ptr, rows_ptr, out_ptr,
                             stride_qt, stride_qh, stride_ot, stride_oh,
                             stride_cb, stride_ch, stride_cs, stride_bt,
                             qk_scale, block_size, head_dim,
                             GROUP: tl.constexpr, DIM_PAD: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (prefill rows, query heads, query tiles). A tile of BLOCK_M query tokens of one row (a whole
    prompt, or a chunk after context already in the cache) attends causally to the row's cached keys,
    its own chunk included (``store_kv`` ran first). Keys past the tile's last position are skipped."""
    row = tl.load(rows_ptr + tl.program_id(0))
    head = tl.program_id(1)
    tile_start = tl.program_id(2) * BLOCK_M
    query_len = tl.load(query_lens_ptr + row)
    if tile_start < query_len:
        seq_len = tl.load(seq_lens_ptr + row)
        first_token = tl.load(query_start_ptr + row).to(tl.int64)
        num_cached = seq_len - query_len
        kv_head = head // GROUP
        offs_m = tile_start + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, DIM_PAD)
        query_mask = offs_m < query_len
        dim_mask = dims < head_dim
        q_positions = num_cached + offs_m
        q = tl.load(q_ptr + (first_token + offs_m[:, None]) * stride_qt + head * stride_qh + dims[None, :],
                    mask=query_mask[:, None] & dim_mask[None, :], other=0.0)
        acc = tl.zeros((BLOCK_M, DIM_PAD), dtype=tl.float32)
        m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        lsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        table = block_tables_ptr + row.to(tl.int64) * stride_bt
        key_end = tl.minimum(seq_len, num_cached + tile_start + BLOCK_M)  # causal: nothing after the tile
        for key_start in range(0, key_end, BLOCK_N):
            pos = key_start + tl.arange(0, BLOCK_N)
            in_row = pos < key_end
            k, v = _load_paged_kv(k_cache_ptr, v_cache_ptr, table, pos, in_row, kv_head, dims, dim_mask, block_size,
                                  stride_cb, stride_ch, stride_cs)
            # Query rows past query_len see key 0 too, so no row is all -inf (they are never stored).
            visible = in_row[None, :] & (pos[None, :] <= q_positions[:, None])
            m, lsum, acc = _online_softmax_step(q, k, v, visible, m, lsum, acc, qk_scale, PRECISION)
        out = acc / lsum[:, None]
        tl.store(out_ptr + (first_token + offs_m[:, None]) * stride_ot + head * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=query_mask[:, None] & dim_mask[None, :])
