"""kernels.triton_fp8: FP8 (e4m3) weights, quantized at load, read by a Triton matmul, against PyTorch.

On a GPU the kernel runs natively; here under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1). The
reference is PyTorch's own float8_e4m3fn decode and ``F.linear`` on the dequantized weight."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from inflight.kernels import triton_fp8  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_quantizing_keeps_each_weight_within_e4m3s_rounding():
    weight = torch.randn(64, 96) * torch.rand(64, 1) * 3
    bits, scale = triton_fp8.quantize(weight)
    assert bits.dtype is torch.uint8 and scale.shape == (64,)
    back = triton_fp8.dequantize(bits, scale)
    # 3 mantissa bits: within 1/16 of each value, or of the smallest normal step near zero
    assert ((back - weight).abs() <= weight.abs() / 16 + scale[:, None] * 2 ** -9).all()
    assert torch.equal(back.abs().amax(1), weight.abs().amax(1).float()) or \
        torch.allclose(back.abs().amax(1), weight.abs().amax(1), rtol=1e-6)


def test_the_kernel_decodes_every_e4m3_byte_as_pytorch_does():
    patterns = torch.arange(256, dtype=torch.uint8)
    finite = patterns[(patterns != 0x7F) & (patterns != 0xFF)]  # e4m3fn's two NaNs checked apart
    bits = finite.repeat(4, 1)  # 4 output rows, each every finite byte
    scale = torch.tensor([1.0, 2.0, 0.5, 0.25])
    x = torch.eye(finite.numel())  # row i picks input i: y[i, r] = weight[r, i] * scale[r]
    y = triton_fp8.fp8_linear(x.to(DEVICE), bits.to(DEVICE), scale.to(DEVICE)).cpu()
    assert torch.equal(y, triton_fp8.dequantize(bits, scale).T)
    nan = triton_fp8.fp8_linear(torch.ones(1, 2, device=DEVICE), torch.tensor([[0x7F, 0]], dtype=torch.uint8,
                                                                              device=DEVICE),
                                torch.ones(1, device=DEVICE))
    assert torch.isnan(nan).all()


@pytest.mark.parametrize("rows", [1, 5, 17, 70])
@pytest.mark.parametrize("n,k", [(96, 64), (130, 200)])  # whole tiles, and tiles cut on both axes
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_equals_pytorch_on_the_dequantized_weight(rows, n, k, bias):
    g = torch.Generator().manual_seed(rows * n + k)
    bits, scale = triton_fp8.quantize(torch.randn(n, k, generator=g) * 0.05)
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = triton_fp8.fp8_linear(x.to(DEVICE), bits.to(DEVICE), scale.to(DEVICE),
                                b.to(DEVICE) if b is not None else None).cpu()
    torch.testing.assert_close(got, triton_fp8.reference_linear(x, bits, scale, b), rtol=1e-5, atol=1e-5)


def test_bfloat16_activations_give_bfloat16_within_one_rounding():
    bits, scale = triton_fp8.quantize(torch.randn(64, 128) * 0.05)
    x = torch.randn(3, 128).bfloat16()
    got = triton_fp8.fp8_linear(x.to(DEVICE), bits.to(DEVICE), scale.to(DEVICE)).cpu()
    assert got.dtype is torch.bfloat16
    # (Triton's interpreter truncates to bf16 where a GPU rounds: up to two units in the last place)
    torch.testing.assert_close(got.float(), triton_fp8.reference_linear(x, bits, scale).float(), rtol=1.6e-2,
                               atol=1e-2)
