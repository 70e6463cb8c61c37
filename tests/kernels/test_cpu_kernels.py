"""kernels.cpu_kernels (C++ through ctypes) and kernels.cpu_backend against the PyTorch code they replace.

Decode attention is checked against ``TorchPagedAttention``'s decode and a dense float64 attention per
row; the backend end to end (prepare, store_kv, forward) against ``TorchPagedAttention`` on the same
inputs; the elementwise kernels against ``engine.models`` (RMSNorm, F.silu, rope.apply_rope), which are
their reference. Inputs are fresh random float32 tensors on the CPU.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
import torch.nn.functional as F

from inflight.engine.models.llama import RMSNorm
from inflight.engine.models.rope import apply_rope
from inflight.kernels import BatchLayout, cpu_kernels, get_attention_backend
from inflight.kernels.torch_ref import TorchPagedAttention
from tests.kernels.cases import NUM_HEADS, batch_rows, naive_attention, run_case

if cpu_kernels.load() is None:
    pytest.skip("the CPU kernels did not build here (no C++ compiler, or INFLIGHT_CPU_KERNELS=0)",
                allow_module_level=True)

from inflight.kernels.cpu_backend import CpuPagedAttention  # noqa: E402

TOKEN_COUNTS = [0, 1, 13, 300]  # 300 x hidden crosses the kernels' threading threshold (1 << 15 elements)
LONG = 700


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def close(got, want, tol=1e-6):
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


class PagedContext:
    """Rows of K/V context in a head-major paged cache [num_kv_heads, num_blocks + 1, block_size, head_dim].

    Blocks are handed out in shuffled order, block tables are zero-padded to the longest row plus
    ``pad_columns``, and every slot that holds no token is finite garbage (1e4 x randn), so any weight
    given to it shows in the result."""

    def __init__(self, seq_lens, num_kv_heads, head_dim, bs, seed, pad_columns=2, spare_blocks=3):
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.seq_lens, self.bs = list(seq_lens), bs
        blocks_per_row = [-(-s // bs) for s in seq_lens]
        self.num_blocks = sum(blocks_per_row) + spare_blocks
        order = list(range(self.num_blocks))
        rng.shuffle(order)
        self.tables, taken = [], 0
        for n in blocks_per_row:
            self.tables.append(order[taken:taken + n])
            taken += n
        width = max(blocks_per_row) + pad_columns
        self.block_tables = torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int64)
        shape = (num_kv_heads, self.num_blocks + 1, bs, head_dim)  # +1: the scratch block
        self.k_cache = torch.randn(shape, generator=gen) * 1e4
        self.v_cache = torch.randn(shape, generator=gen) * 1e4
        self.keys = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]
        self.values = [torch.randn(s, num_kv_heads, head_dim, generator=gen) for s in seq_lens]

    def slots(self, row, positions):
        return torch.tensor([self.tables[row][p // self.bs] * self.bs + p % self.bs for p in positions],
                            dtype=torch.int64)

    def write_all(self):
        """Every row's whole context straight into the caches (no backend involved)."""
        slots = torch.cat([self.slots(r, range(s)) for r, s in enumerate(self.seq_lens)])
        blocks, offsets = slots // self.bs, slots % self.bs
        self.k_cache[:, blocks, offsets] = torch.cat(self.keys).transpose(0, 1)
        self.v_cache[:, blocks, offsets] = torch.cat(self.values).transpose(0, 1)


def decode_seq_lens(bs):
    return [s for s in (1, bs - 1, bs, bs + 1, LONG, 2 * bs + 3) if s >= 1]


def dense_decode(query, ctx, scale):
    """float64 attention of each row's single query token (the last position) to its whole context."""
    return torch.cat([naive_attention(query[r:r + 1], ctx.keys[r], ctx.values[r], torch.tensor([s - 1]), scale)
                      for r, s in enumerate(ctx.seq_lens)])


def torch_decode(query, ctx, scale):
    backend = TorchPagedAttention()
    layout = BatchLayout(query_lens=[1] * len(ctx.seq_lens), seq_lens=ctx.seq_lens, block_tables=ctx.block_tables,
                         slot_mapping=torch.cat([ctx.slots(r, [s - 1]) for r, s in enumerate(ctx.seq_lens)]),
                         block_size=ctx.bs)
    unused = torch.empty(0)  # a decode-only step reads its new K/V from the cache
    return backend.forward(query, unused, unused, ctx.k_cache, ctx.v_cache, backend.prepare(layout), scale)


def kernel_decode(query, ctx, scale):
    return cpu_kernels.paged_decode_attention(query, ctx.k_cache, ctx.v_cache, ctx.block_tables,
                                              torch.tensor(ctx.seq_lens), scale)


# ---- decode attention ---------------------------------------------------------------------------------


def test_the_lanes_setting_is_checked(monkeypatch):
    monkeypatch.setenv("INFLIGHT_CPU_KERNEL_LANES", "12")
    cpu_kernels.load.cache_clear()
    try:
        with pytest.raises(ValueError, match="INFLIGHT_CPU_KERNEL_LANES must be 8 or 16"):
            cpu_kernels.load()
    finally:
        monkeypatch.undo()
        cpu_kernels.load.cache_clear()


@pytest.mark.parametrize("bs", [1, 16, 32])
@pytest.mark.parametrize("head_dim", [32, 48, 64, 128])  # 48: the kernel's runtime head size
@pytest.mark.parametrize("num_kv_heads", [8, 4, 2, 1])
def test_decode_kernel_matches_torch_decode_and_dense(num_kv_heads, head_dim, bs, lanes):
    seed = num_kv_heads * 1000 + head_dim * 10 + bs
    ctx = PagedContext(decode_seq_lens(bs), num_kv_heads, head_dim, bs, seed)
    ctx.write_all()
    query = randn(len(ctx.seq_lens), NUM_HEADS, head_dim, seed=seed + 1)
    scale = head_dim ** -0.5
    k_before, v_before = ctx.k_cache.clone(), ctx.v_cache.clone()

    got = kernel_decode(query, ctx, scale)

    assert got.shape == query.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, torch_decode(query, ctx, scale), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.double(), dense_decode(query, ctx, scale), atol=1e-5, rtol=1e-5)
    assert torch.equal(ctx.k_cache, k_before) and torch.equal(ctx.v_cache, v_before)  # read only


@pytest.mark.parametrize("window,softcap", [(1, None), (5, None), (17, None), (None, 2.0), (5, 2.0)])
def test_decode_kernel_attends_through_a_window_and_caps_scores(window, softcap, lanes):
    """Gemma's and Mistral's decode: each row sees its last ``window`` keys only (windows within a block and across
    blocks of 16), scores capped first; a window block before the window's first holds NaN, which must not show."""
    ctx = PagedContext(decode_seq_lens(16), 2, 64, 16, seed=window or 11)
    ctx.write_all()
    for row, seq_len in enumerate(ctx.seq_lens):  # blocks wholly before a row's window: given back, never read
        for block in ctx.tables[row][:max(0, seq_len - (window or seq_len)) // 16]:
            ctx.k_cache[:, block] = float("nan")
            ctx.v_cache[:, block] = float("nan")
    query = randn(len(ctx.seq_lens), NUM_HEADS, 64, seed=12) * 3
    got = cpu_kernels.paged_decode_attention(query, ctx.k_cache, ctx.v_cache, ctx.block_tables,
                                             torch.tensor(ctx.seq_lens), 0.125, window, softcap)
    want = torch.cat([naive_attention(query[r:r + 1], ctx.keys[r], ctx.values[r], torch.tensor([s - 1]), 0.125,
                                      window, softcap) for r, s in enumerate(ctx.seq_lens)])
    assert got.isfinite().all()
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_decode_kernel_never_reads_past_a_row_length(lanes):
    """Slots past each row's length (its last block's tail, the padding columns' block 0, spare blocks)
    hold NaN: the kernel's output must still equal the dense attention, finite."""
    ctx = PagedContext(decode_seq_lens(16), 2, 64, 16, seed=7)
    ctx.k_cache.fill_(float("nan"))
    ctx.v_cache.fill_(float("nan"))
    ctx.write_all()
    query = randn(len(ctx.seq_lens), NUM_HEADS, 64, seed=8)
    got = kernel_decode(query, ctx, 0.125)
    assert got.isfinite().all()
    torch.testing.assert_close(got.double(), dense_decode(query, ctx, 0.125), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_decode_kernel_nan_in_one_row_stays_in_that_row(num_threads, restore_threads):
    torch.set_num_threads(num_threads)
    ctx = PagedContext([20, 40, 1, 17], num_kv_heads=2, head_dim=32, bs=16, seed=11)
    ctx.write_all()
    query = randn(4, NUM_HEADS, 32, seed=12)
    clean = kernel_decode(query, ctx, 0.2)

    slot = ctx.slots(0, [18])[0]  # row 0, a visible position in its second block
    ctx.k_cache[0, slot // 16, slot % 16, 3] = float("nan")
    ctx.v_cache[1, slot // 16, slot % 16, 5] = float("nan")
    poisoned = kernel_decode(query, ctx, 0.2)

    assert torch.equal(poisoned[1:], clean[1:])
    group = NUM_HEADS // 2
    assert poisoned[0, :group].isnan().all()  # kv head 0's scores are NaN: its whole query group
    assert poisoned[0, group:, 5].isnan().all()  # kv head 1: only the poisoned value column
    assert poisoned[0, group:, :5].isfinite().all() and poisoned[0, group:, 6:].isfinite().all()


# ---- the backend end to end --------------------------------------------------------------------------


def mixed_rows(bs):
    """(query_len, seq_len): decodes, fresh prefills, prefill chunks after cached context, interleaved."""
    decodes = [(1, s) for s in decode_seq_lens(bs)]
    fresh = [(5, 5), (bs, bs), (1 + bs // 2, 1 + bs // 2)]
    chunked = [(3, 10), (bs, 3 * bs), (2, bs + 1), (7, 2 * bs + 10), (40, LONG)]
    rows = []
    for i in range(max(len(decodes), len(fresh), len(chunked))):
        rows += [group[i] for group in (decodes, fresh, chunked) if i < len(group)]
    return rows


def run_backend(backend, ctx, rows, qkv, num_kv_heads, head_dim, scale):
    """Cached context through ``store_kv``, then this step: prepare, store_kv, forward. Returns
    (out, caches after store_kv, caches after forward)."""
    k_cache, v_cache = ctx.k_cache.clone(), ctx.v_cache.clone()
    ctx_rows = [(r, s - q) for r, (q, s) in enumerate(rows) if s > q]
    ctx_layout = BatchLayout(query_lens=[n for _, n in ctx_rows], seq_lens=[n for _, n in ctx_rows],
                             block_tables=ctx.block_tables[[r for r, _ in ctx_rows]],
                             slot_mapping=torch.cat([ctx.slots(r, range(n)) for r, n in ctx_rows]), block_size=ctx.bs)
    backend.store_kv(torch.cat([ctx.keys[r][:n] for r, n in ctx_rows]),
                     torch.cat([ctx.values[r][:n] for r, n in ctx_rows]), k_cache, v_cache, backend.prepare(ctx_layout))

    layout = BatchLayout(query_lens=[q for q, _ in rows], seq_lens=[s for _, s in rows], block_tables=ctx.block_tables,
                         slot_mapping=torch.cat([ctx.slots(r, range(s - q, s)) for r, (q, s) in enumerate(rows)]),
                         block_size=ctx.bs)
    # As the model hands them over: q and k are views of the rotated [tokens, heads + kv_heads, head_dim]
    # tensor, v a view of the qkv projection (token strides wider than heads x head_dim).
    num_tokens = qkv.shape[0]
    qk = qkv[:, :(NUM_HEADS + num_kv_heads) * head_dim].view(num_tokens, NUM_HEADS + num_kv_heads, head_dim)
    query, key = qk.split([NUM_HEADS, num_kv_heads], dim=1)
    value = qkv[:, (NUM_HEADS + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    metadata = backend.prepare(layout)
    backend.store_kv(key, value, k_cache, v_cache, metadata)
    stored = (k_cache.clone(), v_cache.clone())
    out = backend.forward(query, key, value, k_cache, v_cache, metadata, scale)
    return out, stored, (k_cache, v_cache)


@pytest.mark.parametrize("bs", [1, 16])
@pytest.mark.parametrize("num_kv_heads", [2, 8])
def test_backend_matches_torch_backend_on_a_mixed_batch(num_kv_heads, bs):
    head_dim, seed = 32, num_kv_heads * 100 + bs
    rows = mixed_rows(bs)
    ctx = PagedContext([s for _, s in rows], num_kv_heads, head_dim, bs, seed)
    num_tokens = sum(q for q, _ in rows)
    qkv = randn(num_tokens, (NUM_HEADS + 2 * num_kv_heads) * head_dim, seed=seed + 1)
    # this step's K/V are the rows' last query_len positions
    for r, (q, s) in enumerate(rows):
        start = sum(q2 for q2, _ in rows[:r])
        kv = qkv[start:start + q, NUM_HEADS * head_dim:].view(q, 2, num_kv_heads, head_dim)
        ctx.keys[r][s - q:], ctx.values[r][s - q:] = kv[:, 0], kv[:, 1]
    scale = head_dim ** -0.5

    cpu_out, cpu_stored, cpu_after = run_backend(CpuPagedAttention(), ctx, rows, qkv, num_kv_heads, head_dim, scale)
    ref_out, ref_stored, _ = run_backend(TorchPagedAttention(), ctx, rows, qkv, num_kv_heads, head_dim, scale)

    # store_kv: the same slots as the torch backend, the same values, and nothing else touched
    written = torch.zeros(ctx.num_blocks + 1, bs, dtype=torch.bool)
    expected = [ctx.k_cache.clone(), ctx.v_cache.clone()]
    for r, s in enumerate(ctx.seq_lens):
        slots = ctx.slots(r, range(s))
        written[slots // bs, slots % bs] = True
        expected[0][:, slots // bs, slots % bs] = ctx.keys[r].transpose(0, 1)
        expected[1][:, slots // bs, slots % bs] = ctx.values[r].transpose(0, 1)
    for got, ref, want, before in zip(cpu_stored, ref_stored, expected, (ctx.k_cache, ctx.v_cache)):
        assert torch.equal(got[:, written], ref[:, written])
        assert torch.equal(got[:, ~written], before[:, ~written])
        assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(cpu_after, cpu_stored))  # forward leaves the cache alone

    assert cpu_out.shape == (num_tokens, NUM_HEADS, head_dim)
    torch.testing.assert_close(cpu_out, ref_out, atol=1e-5, rtol=1e-5)
    refs, start = [], 0
    query = qkv[:, :NUM_HEADS * head_dim].view(num_tokens, NUM_HEADS, head_dim)
    for r, (q, s) in enumerate(rows):
        refs.append(naive_attention(query[start:start + q], ctx.keys[r], ctx.values[r], torch.arange(s - q, s), scale))
        start += q
    torch.testing.assert_close(cpu_out.double(), torch.cat(refs), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("num_tokens", [1, 7, 8, 9, 33, 300])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(8, 8, 32), (8, 2, 64), (4, 1, 96), (2, 2, 128)])
def test_causal_attention_matches_dense_attention(num_tokens, num_heads, num_kv_heads, head_dim, lanes):
    """A fresh prompt's self-attention (tiles of 8 rows, keys 16 at a time: lengths around and across both),
    against float64 SDPA with the same grouping of query heads."""
    seed = num_tokens * 7 + head_dim
    query = randn(num_tokens, num_heads, head_dim, seed=seed)
    key, value = randn(num_tokens, num_kv_heads, head_dim, seed=seed + 1), randn(num_tokens, num_kv_heads, head_dim,
                                                                              seed=seed + 2)
    scale = head_dim ** -0.5
    got = cpu_kernels.causal_attention(query, key, value, scale)
    want = F.scaled_dot_product_attention(*(t.double().transpose(0, 1)[None] for t in (query, key, value)),
                                          is_causal=True, scale=scale, enable_gqa=num_heads != num_kv_heads)
    assert got.shape == query.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want[0].transpose(0, 1), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["mixed", "decode", "prefill"])
@pytest.mark.parametrize("head_dim", [40, 48, 80])
def test_backend_sends_other_head_sizes_to_torch(head_dim, kind):
    """The causal kernel takes heads in multiples of 32 and the decode kernel in multiples of 16; rows with other
    heads go through torch's attention, and every kind of batch still matches the float64 reference."""
    assert not cpu_kernels.causal_attention_supports(head_dim)
    assert cpu_kernels.decode_attention_supports(head_dim) == (head_dim % 16 == 0)
    out, ref = run_case(CpuPagedAttention(), batch_rows(kind, 4), NUM_HEADS // 2, head_dim, 4, fill=0.0, seed=5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-4)


def test_causal_attention_reads_no_token_after_a_row(lanes):
    """Row t's output depends on tokens 0..t only: poisoning every later token's key and value changes nothing
    before it."""
    query, key, value = randn(40, 4, 32, seed=1), randn(40, 4, 32, seed=2), randn(40, 4, 32, seed=3)
    clean = cpu_kernels.causal_attention(query, key, value, 0.2)
    key[20:], value[20:] = float("nan"), float("nan")
    poisoned = cpu_kernels.causal_attention(query, key, value, 0.2)
    assert torch.equal(poisoned[:20], clean[:20]) and poisoned[20:].isnan().all()


@pytest.mark.parametrize("fill", ["garbage", float("nan")])
@pytest.mark.parametrize("kind", ["mixed", "decode", "prefill"])
def test_backend_never_reads_unwritten_slots(kind, fill):
    """The cpu backend's store_kv keeps NaN (no nan_to_num), so stale NaN in a block's unwritten slots (a
    previous owner's overflow) must never be read: every cache slot starts as ``fill``."""
    rows = batch_rows(kind, 4)
    out, ref = run_case(CpuPagedAttention(), rows, NUM_HEADS // 2, 32, 4, fill=fill, seed=3)
    assert out.isfinite().all()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-4)


# ---- elementwise kernels -----------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_rms_norm_on_strided_rows(num_tokens):
    hidden = 688
    norm = RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(randn(hidden, seed=1))
        wide = randn(num_tokens, hidden + 40, seed=2) * 3
        x = wide[:, 8:8 + hidden]  # stride(0) > hidden, not at the start of its storage either
        wide_before = wide.clone()
        got = cpu_kernels.rms_norm(x, norm.weight, 1e-5)
        close(got, norm(x))
    assert got.is_contiguous()
    assert torch.equal(wide, wide_before)


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_rms_norm_with_residual_writes_the_sum_in_place(num_tokens):
    hidden = 688
    norm = RMSNorm(hidden, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(randn(hidden, seed=3))
        x_wide = randn(num_tokens, hidden + 16, seed=4)
        r_wide = randn(num_tokens, hidden + 24, seed=5)
        x, residual = x_wide[:, :hidden], r_wide[:, 24:]
        x_before, r_before = x_wide.clone(), r_wide.clone()
        want_normed, want_sum = norm(x, residual.clone())
        got = cpu_kernels.rms_norm(x, norm.weight, 1e-6, residual)
        close(got, want_normed)
    assert torch.equal(residual, want_sum)  # x + residual, rounded once
    assert torch.equal(x_wide, x_before)
    assert torch.equal(r_wide[:, :24], r_before[:, :24])  # the columns around the residual are not touched


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_silu_and_mul(num_tokens, strided):
    width = 1500
    wide = randn(num_tokens, 2 * width + (32 if strided else 0), seed=6) * 4
    gate_up = wide[:, :2 * width]
    gate, up = gate_up.split(width, dim=-1)
    close(cpu_kernels.silu_and_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("heads,head_dim", [(6, 64), (3, 128)])
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
def test_rope_on_a_strided_view(num_tokens, heads, head_dim):
    """As the model calls it: q and k heads are a view into the qkv projection (rows longer than
    heads x head_dim); cos/sin are [tokens, 1, head_dim / 2] for arbitrary positions."""
    qkv = randn(num_tokens, (heads + 2) * head_dim, seed=7)
    x = qkv[:, :heads * head_dim].view(num_tokens, heads, head_dim)
    angles = randn(num_tokens, 1, head_dim // 2, seed=8) * 3
    cos, sin = angles.cos(), angles.sin()
    qkv_before = qkv.clone()
    got = cpu_kernels.apply_rope(x, cos, sin)
    close(got, apply_rope(x, cos, sin))
    assert got.is_contiguous()
    assert torch.equal(qkv, qkv_before)


def test_results_do_not_depend_on_the_thread_count(restore_threads):
    """Each kernel above its threading threshold, run with 1 and 2 threads: bitwise the same."""
    ctx = PagedContext(decode_seq_lens(16) * 3, num_kv_heads=4, head_dim=64, bs=16, seed=20)
    ctx.write_all()
    query = randn(len(ctx.seq_lens), NUM_HEADS, 64, seed=21)
    x, residual, weight = randn(300, 256, seed=22), randn(300, 256, seed=23), randn(256, seed=24)
    gate_up = randn(300, 512, seed=25)
    qk = randn(300, 12, 64, seed=26)
    angles = randn(300, 1, 32, seed=27)
    key, value = randn(300, 4, 64, seed=28), randn(300, 4, 64, seed=29)
    slots = torch.randperm(ctx.num_blocks * 16, generator=torch.Generator().manual_seed(30))[:300]

    def run_all():
        r = residual.clone()
        k_cache, v_cache = torch.zeros_like(ctx.k_cache), torch.zeros_like(ctx.v_cache)
        cpu_kernels.store_kv(key, value, k_cache, v_cache, slots)
        return [kernel_decode(query, ctx, 0.125), cpu_kernels.rms_norm(x, weight, 1e-5),
                cpu_kernels.rms_norm(x, weight, 1e-5, r), r, cpu_kernels.silu_and_mul(gate_up),
                cpu_kernels.apply_rope(qk, angles.cos(), angles.sin()), k_cache, v_cache,
                cpu_kernels.causal_attention(qk, key, value, 0.125)]

    results = {}
    for num_threads in (1, 2):
        torch.set_num_threads(num_threads)
        assert torch.get_num_threads() == num_threads
        results[num_threads] = run_all()
    for one, two in zip(results[1], results[2]):
        assert torch.equal(one, two)


# ---- choosing the backend, building the library ------------------------------------------------------


def test_auto_picks_the_cpu_backend_in_float32_and_bfloat16_only():
    cpu = torch.device("cpu")
    assert isinstance(get_attention_backend("auto", cpu, torch.float32), CpuPagedAttention)
    assert isinstance(get_attention_backend("auto", cpu, torch.bfloat16), CpuPagedAttention)
    assert get_attention_backend("auto", cpu, torch.float16).name == "torch"
    with pytest.raises(ValueError, match="attention_backend 'cpu' runs float32 or bfloat16"):
        get_attention_backend("cpu", cpu, torch.float16)


@pytest.fixture
def fresh_load(monkeypatch):
    """``load`` is cached: start it afresh, and leave it as found (the real library) afterwards."""
    cpu_kernels.load.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    cpu_kernels.load.cache_clear()
    assert cpu_kernels.load() is not None


def test_load_can_be_turned_off(fresh_load):
    fresh_load.setenv("INFLIGHT_CPU_KERNELS", "0")
    assert cpu_kernels.load() is None
    assert get_attention_backend("auto", torch.device("cpu"), torch.float32).name == "torch"
    with pytest.raises(ValueError, match="attention_backend 'cpu'"):
        get_attention_backend("cpu", torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("compiler", ["/bin/false", "/nonexistent/c++"])
def test_a_failed_build_logs_and_returns_none(fresh_load, tmp_path, caplog, compiler):
    fresh_load.setenv("CXX", compiler)
    fresh_load.setenv("INFLIGHT_KERNEL_CACHE", str(tmp_path / "kernels"))
    caplog.set_level(logging.WARNING, logger=cpu_kernels.__name__)
    assert cpu_kernels.load() is None
    assert any("building the CPU kernels failed" in r.getMessage() for r in caplog.records)
    assert not list((tmp_path / "kernels").glob("**/*.so"))  # nothing half-built left to load next time


@pytest.mark.slow
def test_kernels_are_built_once_then_loaded_from_the_cache(fresh_load, tmp_path):
    """No compilation in steady state: the first load builds into the cache, every later process loads it."""
    fresh_load.setenv("INFLIGHT_KERNEL_CACHE", str(tmp_path / "kernels"))
    builds = []
    real_build = cpu_kernels.build
    fresh_load.setattr(cpu_kernels, "build", lambda *a: (builds.append(a), real_build(*a)))
    assert cpu_kernels.load() is not None
    assert len(builds) == 1 and len(list((tmp_path / "kernels").glob("*.so"))) == 1
    cpu_kernels.load.cache_clear()  # as a new process would
    assert cpu_kernels.load() is not None
    assert len(builds) == 1, "the cached library was compiled again"
