"""kernels.triton_fused against the PyTorch code it replaces (engine.models.llama / rope), in fp32, fp16, bf16.

The fused kernels round where the PyTorch code rounds, so half-precision results agree to one unit in
the last place at most (the only difference is the order of one fp32 sum), and fp32 ones to 1e-6.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from inflight.engine.models.llama import RMSNorm  # noqa: E402
from inflight.engine.models.rope import apply_rope  # noqa: E402
from inflight.kernels import triton_fused  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# Triton's interpreter truncates fp32 -> bf16 (numpy has no bf16) where a GPU rounds to nearest, so
# there bf16 results may be off by one more unit in the last place (2^-7 relative).
BF16_TOL = 8e-3 if DEVICE == "cuda" else 1.6e-2


def close(got, want):
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: BF16_TOL}[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 688])
def test_rms_norm(dtype, hidden):
    norm = RMSNorm(hidden, 1e-5).to(dtype=dtype, device=DEVICE)
    with torch.no_grad():
        norm.weight.copy_(randn(hidden, dtype=dtype, seed=1))
    x = randn(5, hidden, dtype=dtype, seed=2) * 3
    close(triton_fused.rms_norm(x, norm.weight, 1e-5), norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual_returns_the_sum_in_place(dtype):
    norm = RMSNorm(96, 1e-6).to(dtype=dtype, device=DEVICE)
    x, residual = randn(7, 96, dtype=dtype, seed=3), randn(7, 96, dtype=dtype, seed=4)
    want_normed, want_sum = norm(x, residual.clone())
    got = triton_fused.rms_norm(x, norm.weight, 1e-6, residual)
    close(got, want_normed)
    if dtype != torch.bfloat16 or DEVICE == "cuda":
        assert torch.equal(residual, want_sum)  # the sum is rounded once, exactly like x + residual
    close(residual, want_sum)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [48, 1500])
def test_silu_and_mul(dtype, width):
    gate_up = randn(6, 2 * width, dtype=dtype, seed=5) * 4
    gate, up = gate_up.split(width, dim=-1)
    close(triton_fused.silu_and_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [(6, 64), (3, 128)])
def test_rope_on_a_strided_view(dtype, heads, head_dim):
    """As the model calls it: q and k heads are a view into the fused qkv projection (rows longer than
    heads x head_dim); positions are arbitrary."""
    qkv = randn(9, (heads + 2) * head_dim, dtype=dtype, seed=6)
    x = qkv[:, :heads * head_dim].view(9, heads, head_dim)
    angles = randn(9, 1, head_dim // 2, dtype=torch.float32, seed=7) * 3
    cos, sin = angles.cos(), angles.sin()
    close(triton_fused.apply_rope(x, cos, sin), apply_rope(x, cos, sin))
