"""kernels.torch_ref.TorchPagedAttention against a naive dense causal attention (tests/kernels/cases.py)."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import BatchLayout, get_attention_backend
from inflight.kernels.torch_ref import TorchPagedAttention
from tests.kernels.cases import NUM_HEADS, batch_rows, naive_attention, run_case


@pytest.mark.parametrize("kind", ["mixed", "decode", "prefill"])
@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("gqa", [1, 2, 4])
def test_paged_attention_matches_dense(gqa, head_dim, bs, kind):
    rows = batch_rows(kind, bs)
    out, ref = run_case(TorchPagedAttention(), rows, NUM_HEADS // gqa, head_dim, bs, fill="garbage", seed=gqa * 1000 + head_dim + bs)
    assert out.shape == ref.shape == (sum(q for q, _ in rows), NUM_HEADS, head_dim)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("window,softcap", [(1, None), (3, None), (5, None), (9, None), (None, 1.5), (3, 1.5)])
@pytest.mark.parametrize("kind", ["mixed", "decode", "prefill"])
def test_sliding_window_and_soft_capped_attention_match_dense(kind, window, softcap, backend):
    """Gemma's and Mistral's attention: windows shorter than a block, across one and two blocks (blocks of 4), with
    and without soft-capped scores; garbage in every slot a row does not see. The CPU backend routes such layers
    to the PyTorch paths (its kernels have neither)."""
    attention = TorchPagedAttention() if backend == "torch" else get_attention_backend("cpu", torch.device("cpu"))
    rows = batch_rows(kind, 4) + [(1, 23), (6, 29)]  # contexts several windows long
    out, ref = run_case(attention, rows, NUM_HEADS // 2, 32, 4, fill="garbage", seed=window or 0,
                        window=window, softcap=softcap)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-4)


def test_the_reference_window_and_cap_change_the_result():
    """The oracle's window and cap are sharp: each changes a long row's output."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(6, 4, 16, generator=gen), torch.randn(20, 4, 16, generator=gen) * 3, torch.randn(20, 4, 16, generator=gen)
    positions = torch.arange(14, 20)
    plain = naive_attention(q, k, v, positions, 0.5)
    assert not torch.allclose(plain, naive_attention(q, k, v, positions, 0.5, window=4))
    assert not torch.allclose(plain, naive_attention(q, k, v, positions, 0.5, softcap=1.0))
    torch.testing.assert_close(plain, naive_attention(q, k, v, positions, 0.5, window=20))


@pytest.mark.parametrize("kind", ["mixed", "decode", "prefill"])
def test_masked_cache_slots_are_never_read_into_the_result(kind):
    """Every cache slot that holds no token of its row holds a huge (finite) value: unused blocks, the
    0-padding of short block tables, the tail of each row's last block, the scratch block. None of it may
    reach the output. (The backend may read masked slots, weighted by an exact zero; store_kv guarantees
    they are finite, see the next test.)"""
    rows = batch_rows(kind, 4)
    out, ref = run_case(TorchPagedAttention(), rows, NUM_HEADS // 2, 32, 4, fill=1e30, seed=5)
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
