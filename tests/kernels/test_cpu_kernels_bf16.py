"""The CPU kernels in bfloat16 against the same kernels in float32 (tests/kernels/test_cpu_kernels.py checks those
against PyTorch and float64).

A bfloat16 kernel widens its inputs exactly, runs the float32 kernel's arithmetic in the same order, and rounds
its result once: so it must give, bit for bit, the float32 kernel's result on the widened inputs rounded to
bfloat16. The exceptions: attention where the build has AVX-512 BF16 (scores on dot products, and in the decode
kernel bf16 softmax weights: close, not the same bits), and the norm with the residual add, which rounds the new residual stream as it stores
it and normalises that; and the norm's sum of squares may add its lanes in another order (within one unit in the
last place). Both lane widths (the ``lanes`` fixture).
"""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import cpu_kernels
from tests.kernels.test_cpu_kernels import PagedContext, decode_seq_lens

if cpu_kernels.load() is None:
    pytest.skip("the CPU kernels did not build here (no C++ compiler, or INFLIGHT_CPU_KERNELS=0)",
                allow_module_level=True)


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16)


def rounded(t: torch.Tensor) -> torch.Tensor:
    """What a bfloat16 kernel must store for the float32 result ``t``: round to nearest even."""
    assert t.dtype == torch.float32
    return t.to(torch.bfloat16)


def same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    mismatch = (got.view(torch.int16) != want.view(torch.int16)).sum().item()
    assert mismatch == 0, f"{mismatch} of {got.numel()} values differ; largest gap " \
                          f"{(got.float() - want.float()).abs().max().item()}"


def within_one_unit(got: torch.Tensor, want: torch.Tensor) -> None:
    """For the norm: its sum of squares is a reduction whose lane order the compiler picks per loop and type."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    apart = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert apart.max() <= 1 and (apart == 0).float().mean() > 0.99, apart.max()


def randn(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("window,softcap", [(None, None), (5, 2.0)])  # (Gemma's layers: a window, capped scores)
@pytest.mark.parametrize("head_dim", [32, 48, 64])
@pytest.mark.parametrize("num_kv_heads", [4, 1])
def test_decode_attention(num_kv_heads, head_dim, window, softcap, lanes):
    ctx = PagedContext(decode_seq_lens(16), num_kv_heads, head_dim, 16, seed=3)
    ctx.write_all()
    query = bf16(randn(len(ctx.seq_lens), 8, head_dim, seed=4))
    k_cache, v_cache = bf16(ctx.k_cache), bf16(ctx.v_cache)
    lens = torch.tensor(ctx.seq_lens)
    got = cpu_kernels.paged_decode_attention(query, k_cache, v_cache, ctx.block_tables, lens, 0.125, window, softcap)
    want = cpu_kernels.paged_decode_attention(query.float(), k_cache.float(), v_cache.float(), ctx.block_tables,
                                              lens, 0.125, window, softcap)
    if cpu_kernels.bf16_dot_products() and head_dim % 32 == 0:  # scores on dot products: another order of sums
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
        assert (got.float() - want).abs().mean() < 1e-3
    else:
        same_bits(got, rounded(want))


@pytest.mark.parametrize("num_tokens", [1, 9, 300])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(8, 2, 64), (4, 1, 96)])
def test_causal_attention(num_tokens, num_heads, num_kv_heads, head_dim, lanes):
    q = bf16(randn(num_tokens, num_heads, head_dim, seed=1))
    k = bf16(randn(num_tokens, num_kv_heads, head_dim, seed=2))
    v = bf16(randn(num_tokens, num_kv_heads, head_dim, seed=3))
    got = cpu_kernels.causal_attention(q, k, v, 0.1)
    want = cpu_kernels.causal_attention(q.float(), k.float(), v.float(), 0.1)
    if not cpu_kernels.bf16_dot_products():
        same_bits(got, rounded(want))
    else:  # scores and V pass on dot products (weights rounded to bf16, sums in another order): close, not the same bits
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
        assert (got.float() - want).abs().mean() < 2e-3


def test_causal_attention_reads_no_token_after_a_row(lanes):
    """As in float32: poisoning every later token's key and value (NaN) changes nothing before it, on the dot
    product path too (a later key's score lane is its own; its value never meets a zero weight)."""
    for tokens, cut in ((40, 20), (41, 21), (9, 4)):
        q, k, v = (bf16(randn(tokens, 4, 32, seed=s)) for s in (1, 2, 3))
        clean = cpu_kernels.causal_attention(q, k, v, 0.2)
        k[cut:], v[cut:] = float("nan"), float("nan")
        poisoned = cpu_kernels.causal_attention(q, k, v, 0.2)
        same_bits(poisoned[:cut], clean[:cut])
        assert poisoned[cut:].isnan().all()


@pytest.mark.parametrize("rows", [1, 3, 4, 16])
@pytest.mark.parametrize("in_features, out_features", [(576, 1536), (1536, 576), (64, 100)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear(rows, in_features, out_features, with_bias, lanes):
    weight = bf16(randn(out_features, in_features, seed=5, scale=0.05))
    x = bf16(randn(rows, in_features, seed=6))
    bias = bf16(randn(out_features, seed=7)) if with_bias else None
    got = cpu_kernels.linear(x, cpu_kernels.pack_linear(weight), bias, out_features)
    want = cpu_kernels.linear(x.float(), cpu_kernels.pack_linear(weight.float()), None, out_features)
    if bias is not None:  # the float32 kernel adds the bias last too, to the float32 sum
        want = want + bias.float()
    same_bits(got, rounded(want))
    # and it is the matmul, to bfloat16's precision
    torch.testing.assert_close(got.float(), x.float() @ weight.float().T + (bias.float() if with_bias else 0),
                               atol=0.05, rtol=0.02)


@pytest.mark.parametrize("num_tokens", [1, 13, 300])
def test_rms_norm_and_its_residual(num_tokens, lanes):
    x, residual = bf16(randn(num_tokens, 576, seed=8)), bf16(randn(num_tokens, 576, seed=9))
    weight = bf16(1 + randn(576, seed=10, scale=0.1))
    plain = cpu_kernels.rms_norm(x, weight, 1e-5)
    within_one_unit(plain, rounded(cpu_kernels.rms_norm(x.float(), weight.float(), 1e-5)))
    new_residual = rounded(x.float() + residual.float())  # the stream is stored in bfloat16, then normalised
    got = cpu_kernels.rms_norm(x, weight, 1e-5, residual)
    same_bits(residual, new_residual)
    within_one_unit(got, rounded(cpu_kernels.rms_norm(new_residual.float(), weight.float(), 1e-5)))


@pytest.mark.parametrize("num_tokens", [1, 300])
def test_silu_and_mul(num_tokens, lanes):
    gate_up = bf16(randn(num_tokens, 2 * 1536, seed=11, scale=3))
    same_bits(cpu_kernels.silu_and_mul(gate_up), rounded(cpu_kernels.silu_and_mul(gate_up.float())))


@pytest.mark.parametrize("num_tokens", [1, 300])
def test_rope_on_a_strided_view(num_tokens, lanes):
    qkv = bf16(randn(num_tokens, 12, 64, seed=12))
    x = qkv[:, :9]  # q and k heads of a fused projection: a token stride wider than the view
    angles = randn(num_tokens, 1, 32, seed=13)
    cos, sin = angles.cos(), angles.sin()
    same_bits(cpu_kernels.apply_rope(x, cos, sin), rounded(cpu_kernels.apply_rope(x.float(), cos, sin)))


def test_store_kv_copies_bits():
    key, value = bf16(randn(5, 2, 32, seed=14)), bf16(randn(5, 2, 32, seed=15))
    k_cache = torch.zeros(2, 4, 4, 32, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([15, 0, 6, 9, 2])
    cpu_kernels.store_kv(key, value, k_cache, v_cache, slots)
    for t, slot in enumerate(slots.tolist()):
        same_bits(k_cache[:, slot // 4, slot % 4], key[t])
        same_bits(v_cache[:, slot // 4, slot % 4], value[t])


def test_rounding_is_to_nearest_even_and_keeps_nan_and_inf():
    # Each row's float32 result is a + b (a linear with weights of one), chosen at and around bfloat16's ties and
    # past its range; the store must round as torch's conversion does.
    pairs = [(1.0, 2 ** -8), (1 + 2 ** -7, 2 ** -8), (1.0, 2 ** -8 + 2 ** -14), (-1.0, -(2 ** -8)),
             (3.0e38, 3.0e38), (float("inf"), 1.0), (float("inf"), float("-inf")), (0.0, -0.0)]
    x = torch.tensor(pairs, dtype=torch.bfloat16)
    ones = cpu_kernels.pack_linear(torch.ones(1, 2, dtype=torch.bfloat16))
    got = cpu_kernels.linear(x, ones, None, 1)[:, 0]
    want = rounded(x.float().sum(dim=1))
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().sum() == 1
    same_bits(got[~got.isnan()], want[~want.isnan()])
    assert got[:3].tolist() == [1.0, 1 + 2 ** -6, 1 + 2 ** -7]  # ties to even; above a tie, up


def test_mixed_dtypes_are_refused():
    with pytest.raises(AssertionError, match="float32 or bfloat16"):
        cpu_kernels.silu_and_mul(torch.ones(1, 4, dtype=torch.float16))
    with pytest.raises(AssertionError, match="one dtype"):
        cpu_kernels.rms_norm(torch.ones(1, 4, dtype=torch.bfloat16), torch.ones(4), 1e-5)


needs_dot = pytest.mark.skipif(not cpu_kernels.bf16_dot_products(),
                               reason="the kernels' build here has no AVX-512 BF16 dot products")


@needs_dot
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 33, 70])
@pytest.mark.parametrize("in_features, out_features", [(576, 960), (1536, 576), (63, 100), (65, 17), (129, 48),
                                                       (255, 50)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_on_dot_products_is_the_matmul(rows, in_features, out_features, with_bias):
    """Odd inputs (the last pairs with zero, alone in the last chunk of inputs at 129), outputs that fill no whole
    block of 16 or task of 3 blocks, a bias, and rows in groups of 8 and the rest, in chunks of inputs (2-8 groups)
    or not (1 group, 9): the float32 sum of the bfloat16 products, rounded once."""
    weight = bf16(randn(out_features, in_features, seed=20, scale=0.05))
    wide = bf16(randn(rows, in_features + 3, seed=21))
    x = wide[:, 1:in_features + 1]  # a row stride wider than the row
    bias = bf16(randn(out_features, seed=22)) if with_bias else None
    got = cpu_kernels.linear_pairs(x, cpu_kernels.pack_linear_pairs(weight), bias, out_features)
    exact = x.double() @ weight.double().T + (bias.double() if with_bias else 0)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    torch.testing.assert_close(got.double(), exact, atol=2e-3 * in_features ** 0.5, rtol=2 ** -7)
    # and oneDNN's bf16 matmul, which multiplies the same way, agrees to a unit in the last place
    onednn = torch.ops.mkldnn._linear_pointwise(x.contiguous(), torch.ops.mkldnn._reorder_linear_weight(weight, 64),
                                                bias, "none", [], "")
    apart = (got.view(torch.int16).int() - onednn.view(torch.int16).int()).abs()
    assert (apart <= 1).float().mean() > 0.99


@needs_dot
@pytest.mark.parametrize("in_features", [576, 255])
def test_linear_on_dot_products_gives_a_row_the_bits_it_gets_in_any_batch(in_features):
    """One row alone, in a group of 8, among 2-8 groups (chunked inputs) and among 9 (one pass per group): the same
    sums in the same order, so the same bits (the engine relies on it: a prompt's tokens do not depend on its batch)."""
    weight = bf16(randn(100, in_features, seed=23, scale=0.05))
    packed = cpu_kernels.pack_linear_pairs(weight)
    x = bf16(randn(70, in_features, seed=24))
    whole = cpu_kernels.linear_pairs(x, packed, None, 100, torch.float32)
    for rows in (1, 5, 8, 13, 64):
        part = cpu_kernels.linear_pairs(x[-rows:], packed, None, 100, torch.float32)
        assert torch.equal(part, whole[-rows:]), f"{rows} rows"


@needs_dot
def test_linear_on_dot_products_reads_no_input_past_a_row():
    """An odd width: the last input pairs with zero, not with the next row's first input (NaN here)."""
    x = torch.full((2, 6), float("nan"), dtype=torch.bfloat16)
    x[0, :5] = 1.0
    got = cpu_kernels.linear_pairs(x[:, :5], cpu_kernels.pack_linear_pairs(torch.ones(3, 5, dtype=torch.bfloat16)),
                                   None, 3)
    assert got[0].tolist() == [5.0, 5.0, 5.0] and got[1].isnan().all()


@pytest.mark.parametrize("num_tokens", [1, 13, 300])
def test_rms_norm_with_a_float32_residual_stream(num_tokens, lanes):
    """Under bf16 layers the stream may be float32: the sum is kept unrounded, and normalised from it."""
    x, weight = bf16(randn(num_tokens, 576, seed=30)), bf16(1 + randn(576, seed=31, scale=0.1))
    residual = randn(num_tokens, 576, seed=32)
    want_stream = residual + x.float()
    got = cpu_kernels.rms_norm(x, weight, 1e-5, residual)
    assert residual.dtype == torch.float32 and torch.equal(residual, want_stream)
    within_one_unit(got, rounded(cpu_kernels.rms_norm(want_stream, weight.float(), 1e-5)))
