"""kernels.torch_ref.TorchPagedAttention against a naive dense causal attention written here.

Each case is a batch of rows (query_len, seq_len): decodes (query_len 1), fresh prefills
(seq_len == query_len) and prefill chunks after cached context (seq_len > query_len), with ragged
lengths, seq_len 1 and exact block boundaries. Blocks are handed out in shuffled order, so no row's
table is contiguous. Context KV is written through the backend's own ``store_kv`` (so the test does
not depend on the cache layout), then the step's new KV, then ``forward`` is compared.
"""

from __future__ import annotations

import inspect
import random

import pytest
import torch

from kernels import BatchLayout
from kernels.torch_ref import TorchPagedAttention

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


def naive_attention(q, k, v, positions, scale):
    """q [q_len, H, D] at absolute ``positions``; k, v [seq_len, KVH, D]; float64 dense causal attention."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    visible = torch.arange(k.shape[0])[None, :] <= positions[:, None]  # [q_len, seq_len]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def attend(backend, query, key, value, k_cache, v_cache, metadata, scale):
    """``forward`` is being extended to take the step's new key/value too; call whichever this build has."""
    if "key" in inspect.signature(backend.forward).parameters:
        return backend.forward(query, key, value, k_cache, v_cache, metadata, scale)
    return backend.forward(query, k_cache, v_cache, metadata, scale)


def cache_shape(backend, num_blocks, bs, kvh, hd):
    if hasattr(backend, "kv_cache_shape"):
        return backend.kv_cache_shape(num_blocks, bs, kvh, hd)
    return (num_blocks, bs, kvh, hd)


def run_case(rows, num_kv_heads, head_dim, bs, fill, seed=0):
    """Build caches filled with ``fill`` (a float, or 'garbage'), run the backend; return (out, reference)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    backend = TorchPagedAttention()
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

    shape = cache_shape(backend, num_blocks + 1, bs, num_kv_heads, head_dim)  # +1: the scratch block
    if fill == "garbage":  # huge finite values: any weight on a masked key or value shows up in the result
        k_cache = torch.randn(shape, generator=gen) * 1e4
        v_cache = torch.randn(shape, generator=gen) * 1e4
    else:
        k_cache = torch.full(shape, fill)
        v_cache = torch.full(shape, fill)

    def slot(row, pos):
        return tables[row][pos // bs] * bs + pos % bs

    full_k = [torch.randn(seq_len, num_kv_heads, head_dim, generator=gen) for _, seq_len in rows]
    full_v = [torch.randn(seq_len, num_kv_heads, head_dim, generator=gen) for _, seq_len in rows]

    # 1. the cached context (positions before each row's query) goes in through store_kv
    ctx_rows = [(r, seq_len - q_len) for r, (q_len, seq_len) in enumerate(rows) if seq_len > q_len]
    if ctx_rows:
        ctx_layout = BatchLayout(
            query_lens=[n for _, n in ctx_rows], seq_lens=[n for _, n in ctx_rows],
            block_tables=block_tables[[r for r, _ in ctx_rows]],
            slot_mapping=torch.tensor([slot(r, p) for r, n in ctx_rows for p in range(n)]), block_size=bs)
        backend.store_kv(torch.cat([full_k[r][:n] for r, n in ctx_rows]), torch.cat([full_v[r][:n] for r, n in ctx_rows]),
                         k_cache, v_cache, backend.prepare(ctx_layout))

    # 2. this step: each row's query tokens, their new KV, attention
    q_lens = [q for q, _ in rows]
    seq_lens = [s for _, s in rows]
    layout = BatchLayout(
        query_lens=q_lens, seq_lens=seq_lens, block_tables=block_tables,
        slot_mapping=torch.tensor([slot(r, p) for r, (q, s) in enumerate(rows) for p in range(s - q, s)]),
        block_size=bs)
    query = torch.randn(sum(q_lens), NUM_HEADS, head_dim, generator=gen)
    key = torch.cat([full_k[r][s - q:] for r, (q, s) in enumerate(rows)])
    value = torch.cat([full_v[r][s - q:] for r, (q, s) in enumerate(rows)])
    scale = head_dim ** -0.5
    metadata = backend.prepare(layout)
    backend.store_kv(key, value, k_cache, v_cache, metadata)
    out = attend(backend, query, key, value, k_cache, v_cache, metadata, scale)

    refs, start = [], 0
    for r, (q, s) in enumerate(rows):
        refs.append(naive_attention(query[start:start + q], full_k[r], full_v[r], torch.arange(s - q, s), scale))
        start += q
    return out, torch.cat(refs)


@pytest.mark.parametrize("kind", ["mixed", "decode", "prefill"])
@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("gqa", [1, 2, 4])
def test_paged_attention_matches_dense(gqa, head_dim, bs, kind):
    rows = batch_rows(kind, bs)
    out, ref = run_case(rows, NUM_HEADS // gqa, head_dim, bs, fill="garbage", seed=gqa * 1000 + head_dim + bs)
    assert out.shape == ref.shape == (sum(q for q, _ in rows), NUM_HEADS, head_dim)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["mixed", "decode", "prefill"])
def test_masked_cache_slots_are_never_read_into_the_result(kind):
    """Every cache slot that holds no token of its row holds a huge (finite) value: unused blocks, the
    0-padding of short block tables, the tail of each row's last block, the scratch block. None of it may
    reach the output. (The backend may read masked slots, weighted by an exact zero; store_kv guarantees
    they are finite, see the next test.)"""
    rows = batch_rows(kind, 4)
    out, ref = run_case(rows, NUM_HEADS // 2, 32, 4, fill=1e30, seed=5)
    row_of_token = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([q for q, _ in rows]))
    bad_rows = sorted(set(row_of_token[(~out.isfinite()).flatten(1).any(dim=1)].tolist()))
    assert not bad_rows, f"masked cache slots reached rows {[rows[r] for r in bad_rows]} (query_len, seq_len)"
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-4)


def test_store_kv_never_writes_non_finite_values():
    """A request whose K/V overflowed must not leave inf/NaN in the cache for a later owner of the block."""
    backend = TorchPagedAttention()
    shape = backend.kv_cache_shape(3, 4, 2, 8)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    key = torch.full((5, 2, 8), float("inf"))
    value = torch.full((5, 2, 8), float("nan"))
    layout = BatchLayout(query_lens=[5], seq_lens=[5], block_tables=torch.tensor([[1, 2]]),
                         slot_mapping=torch.arange(4, 9), block_size=4)
    backend.store_kv(key, value, k_cache, v_cache, backend.prepare(layout))
    assert k_cache.isfinite().all() and v_cache.isfinite().all()
    assert (k_cache != 0).sum() == 5 * 2 * 8  # the five tokens were written


def test_reference_detects_a_wrong_mask():
    """The oracle itself must be sharp: dropping causality changes the result of a prefill row."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, 4, 16, generator=gen) for _ in range(3))
    causal = naive_attention(q, k, v, torch.arange(6), 0.25)
    full = naive_attention(q, k, v, torch.full((6,), 5), 0.25)
    assert not torch.allclose(causal[:-1], full[:-1])
    torch.testing.assert_close(causal[-1], full[-1])
