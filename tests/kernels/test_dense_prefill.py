"""kernels.dense_prefill (the prefill-only lane's no-cache attention) against the dense float64 oracle."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import cpu_kernels, get_attention_backend
from inflight.kernels.dense_prefill import DensePrefillMetadata, dense_prefill_attention, sdpa_prompt_attention
from tests.kernels.cases import NUM_HEADS, naive_attention


def attentions():
    """SDPA (every backend's default) and, where its kernels build, the CPU backend's causal kernel."""
    yield pytest.param(sdpa_prompt_attention, id="sdpa")
    built = cpu_kernels.load() is not None
    backend = get_attention_backend("cpu", torch.device("cpu")) if built else None
    yield pytest.param(backend.prompt_attention if built else None, id="cpu-kernel",
                       marks=pytest.mark.skipif(not built, reason="no C++ compiler: the CPU kernels are not built"))


@pytest.mark.parametrize("attend", attentions())
@pytest.mark.parametrize("gqa", [1, 2, 4])
@pytest.mark.parametrize("lengths", [[1], [5, 1, 17, 3], [40, 40]], ids=["one-token", "ragged", "equal"])
def test_each_prompt_attends_causally_to_itself_only(gqa, lengths, attend):
    gen = torch.Generator().manual_seed(gqa + len(lengths))
    num_tokens, head_dim = sum(lengths), 32
    q = torch.randn(num_tokens, NUM_HEADS, head_dim, generator=gen)
    k, v = (torch.randn(num_tokens, NUM_HEADS // gqa, head_dim, generator=gen) for _ in range(2))
    out = dense_prefill_attention(q, k, v, DensePrefillMetadata(lengths), 0.2, attend)
    start = 0
    for length in lengths:
        rows = slice(start, start + length)
        want = naive_attention(q[rows], k[rows], v[rows], torch.arange(length), 0.2)
        torch.testing.assert_close(out[rows].double(), want, atol=1e-5, rtol=1e-4)
        start += length


@pytest.mark.parametrize("attend", attentions())
@pytest.mark.parametrize("window,softcap", [(1, None), (6, None), (None, 2.0), (6, 2.0)])
def test_sliding_window_and_soft_capped_prompts(window, softcap, attend):
    """A prefill-lane batch of a Gemma or Mistral layer: each query sees its last ``window`` keys, scores capped."""
    gen = torch.Generator().manual_seed(window or 7)
    lengths, head_dim = [5, 300, 2], 32  # 300: more than one tile of query rows
    q = torch.randn(sum(lengths), NUM_HEADS, head_dim, generator=gen)
    k, v = (torch.randn(sum(lengths), NUM_HEADS // 2, head_dim, generator=gen) for _ in range(2))
    out = dense_prefill_attention(q, k, v, DensePrefillMetadata(lengths), 0.5, attend, window=window, softcap=softcap)
    start = 0
    for length in lengths:
        rows = slice(start, start + length)
        want = naive_attention(q[rows], k[rows], v[rows], torch.arange(length), 0.5, window, softcap)
        torch.testing.assert_close(out[rows].double(), want, atol=1e-5, rtol=1e-4)
        start += length


def test_prompts_do_not_see_each_other():
    """Changing one prompt's keys leaves the other prompts' outputs exactly as they were."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, 4, 16, generator=gen) for _ in range(3))
    meta = DensePrefillMetadata([5, 7])
    before = dense_prefill_attention(q, k, v, meta, 0.25)
    k2 = k.clone()
    k2[5:] += 3.0
    after = dense_prefill_attention(q, k2, v, meta, 0.25)
    assert torch.equal(before[:5], after[:5])
    assert not torch.allclose(before[5:], after[5:])
