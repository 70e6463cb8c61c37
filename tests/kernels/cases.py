"""Attention test cases shared by every backend's tests, and the dense float64 oracle.

Each case is a batch of rows (query_len, seq_len): decodes (query_len 1), fresh prefills
(seq_len == query_len) and prefill chunks after cached context (seq_len > query_len), with ragged
lengths, seq_len 1 and exact block boundaries. Blocks are handed out in shuffled order, so no row's
table is contiguous. Context KV is written through the backend's own ``store_kv`` (so the test does
not depend on the cache layout), then the step's new KV, then ``forward`` is compared.
"""

from __future__ import annotations

import random

import torch

from inflight.kernels import BatchLayout

NUM_HEADS = 8
SPARE_BLOCKS = 5  # blocks nobody holds


def batch_rows(kind: str, bs: int) -> list[tuple[int, int]]:
    """(query_len, seq_len) per row."""
    decodes = [(1, 1), (1, 7), (1, bs), (1, 2 * bs + 1), (1, 3 * bs)]
    fresh = [(5, 5), (bs, bs), (2, 2)]
    chunked = [(3, 10), (bs, 3 * bs), (2, bs + 1), (7, 2 * bs + 3)]
    if kind == "decode":
        return decodes
    if kind == "prefill":
        return fresh + chunked
    return [decodes[1], fresh[0], chunked[0], decodes[0], chunked[1], decodes[3], fresh[1], decodes[2], chunked[2]]


def naive_attention(q, k, v, positions, scale, window=None, softcap=None):
    """q [q_len, H, D] at absolute ``positions``; k, v [seq_len, KVH, D]; float64 dense causal attention, as
    transformers computes it: scores soft-capped (``cap * tanh(score / cap)``), then masked; a ``window`` shows each
    query only keys less than ``window`` positions before it."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    keys = torch.arange(k.shape[0])[None, :]
    visible = keys <= positions[:, None]  # [q_len, seq_len]
    if window is not None:
        visible &= keys > positions[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def run_case(backend, rows, num_kv_heads, head_dim, bs, fill, seed=0, num_heads=NUM_HEADS, dtype=torch.float32,
             device="cpu", out_fill=None, window=None, softcap=None):
    """Build caches filled with ``fill`` (a float, or 'garbage'), run the backend; return (out, reference).
    ``window``, ``softcap``: the layer's sliding window and score cap, passed when set.

    ``out_fill``: hand ``forward`` an output buffer poisoned with this value (backends that take one),
    so an element the kernel forgets to write shows up."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_per_row = [-(-seq_len // bs) for _, seq_len in rows]
    num_blocks = sum(blocks_per_row) + SPARE_BLOCKS
    order = list(range(num_blocks))
    rng.shuffle(order)
    tables, taken = [], 0
    for n in blocks_per_row:
        tables.append(order[taken:taken + n])
        taken += n
    width = max(blocks_per_row)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)  # padded with 0

    shape = backend.kv_cache_shape(num_blocks + 1, bs, num_kv_heads, head_dim)  # +1: the scratch block
    if fill == "garbage":  # huge finite values: any weight on a masked key or value shows up in the result
        k_cache = torch.randn(shape, generator=gen) * 1e4
        v_cache = torch.randn(shape, generator=gen) * 1e4
    else:
        k_cache = torch.full(shape, fill)
        v_cache = torch.full(shape, fill)
    k_cache, v_cache = k_cache.to(device=device, dtype=dtype), v_cache.to(device=device, dtype=dtype)

    def slot(row, pos):
        return tables[row][pos // bs] * bs + pos % bs

    full_k = [torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype) for _, seq_len in rows]
    full_v = [torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype) for _, seq_len in rows]
    on = lambda t: t.to(device)  # noqa: E731

    # 1. the cached context (positions before each row's query) goes in through store_kv
    ctx_rows = [(r, seq_len - q_len) for r, (q_len, seq_len) in enumerate(rows) if seq_len > q_len]
    if ctx_rows:
        ctx_layout = BatchLayout(
            query_lens=[n for _, n in ctx_rows], seq_lens=[n for _, n in ctx_rows],
            block_tables=on(block_tables[[r for r, _ in ctx_rows]]),
            slot_mapping=on(torch.tensor([slot(r, p) for r, n in ctx_rows for p in range(n)])), block_size=bs)
        backend.store_kv(on(torch.cat([full_k[r][:n] for r, n in ctx_rows])),
                         on(torch.cat([full_v[r][:n] for r, n in ctx_rows])),
                         k_cache, v_cache, backend.prepare(ctx_layout))

    # 2. this step: each row's query tokens, their new KV, attention
    q_lens = [q for q, _ in rows]
    seq_lens = [s for _, s in rows]
    layout = BatchLayout(
        query_lens=q_lens, seq_lens=seq_lens, block_tables=on(block_tables),
        slot_mapping=on(torch.tensor([slot(r, p) for r, (q, s) in enumerate(rows) for p in range(s - q, s)])),
        block_size=bs)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    key = torch.cat([full_k[r][s - q:] for r, (q, s) in enumerate(rows)])
    value = torch.cat([full_v[r][s - q:] for r, (q, s) in enumerate(rows)])
    scale = head_dim ** -0.5
    metadata = backend.prepare(layout)
    backend.store_kv(on(key), on(value), k_cache, v_cache, metadata)
    kwargs = {name: value for name, value in (("window", window), ("softcap", softcap)) if value is not None}
    if out_fill is not None:
        kwargs["out"] = torch.full(query.shape, out_fill, dtype=dtype, device=device)
    out = backend.forward(on(query), on(key), on(value), k_cache, v_cache, metadata, scale, **kwargs)

    refs, start = [], 0
    for r, (q, s) in enumerate(rows):
        refs.append(naive_attention(query[start:start + q], full_k[r], full_v[r], torch.arange(s - q, s), scale,
                                    window, softcap))
        start += q
    return out.cpu(), torch.cat(refs)
