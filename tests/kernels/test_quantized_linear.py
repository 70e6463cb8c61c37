"""kernels.quantized: linears on weights kept quantized (q4: Q4_0/Q4_1/Q4_K, q8: Q8_0) against their references.

``reference_linear`` is the same arithmetic in float64 from the same integers (activations quantized per block of
32, exact integer dot products, scaled): the kernel must equal it up to float32 summation. Against the float
matmul of the dequantized weight it differs only by the activations' int8 rounding (~1%). Both builds (the VNNI
code at 16 lanes, the scalar code at 8) must give the same bits, and a row's result must not depend on its batch.
"""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import cpu_kernels, quantized

if cpu_kernels.load() is None:
    pytest.skip("the CPU kernels did not build here (no C++ compiler, or INFLIGHT_CPU_KERNELS=0)",
                allow_module_level=True)

ROWS = [1, 2, 3, 4, 5, 13, 64, 67, 130]  # tiles of 4 rows and what is left; chunks of 64 rows and what is left


def random_weight(fmt: str, n: int, k: int, seed: int = 0) -> quantized.QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(n, k // 32, generator=g) * 0.01 + 0.001
    if fmt == "q4":
        return quantized.pack_q4(torch.randint(0, 16, (n, k), generator=g), scale,
                                 -torch.rand(n, k // 32, generator=g) * 0.1)
    return quantized.pack_q8(torch.randint(-128, 128, (n, k), generator=g), scale)


@pytest.mark.parametrize("n,k", [(48, 64), (40, 96), (577, 576)])  # whole groups of 16 rows, a padded last one
def test_packing_keeps_every_integer_scale_and_minimum(n, k):
    g = torch.Generator().manual_seed(n)
    q4, q8 = torch.randint(0, 16, (n, k), generator=g), torch.randint(-128, 128, (n, k), generator=g)
    scale, minimum = torch.rand(n, k // 32, generator=g), -torch.rand(n, k // 32, generator=g)
    for weight, want in ((quantized.pack_q4(q4, scale, minimum), (q4, scale, minimum)),
                         (quantized.pack_q8(q8, scale), (q8, scale, torch.zeros_like(scale)))):
        got = quantized.unpack(weight)
        assert all(torch.equal(a, b.to(a.dtype)) for a, b in zip(got, want)), weight.format
        blocks = want[0].double().reshape(n, -1, 32) * scale.double()[..., None] + want[2].double()[..., None]
        assert torch.equal(quantized.dequantize(weight), blocks.reshape(n, k).float())


@pytest.mark.parametrize("fmt", quantized.FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_equals_the_integer_reference_at_every_row_count(fmt, dtype, bias, lanes):
    n, k = 70, 192
    weight = random_weight(fmt, n, k)
    b = (torch.randn(n) * 0.1).to(dtype) if bias else None
    x = torch.randn(max(ROWS), k).to(dtype)
    for rows in ROWS:
        got = quantized.quant_linear(x[:rows], weight, b)
        want = quantized.reference_linear(x[:rows], weight, b)
        assert got.dtype is dtype and got.shape == (rows, n)
        if dtype is torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        else:  # one rounding to bfloat16 at the end
            torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-3)


@pytest.mark.parametrize("fmt", quantized.FORMATS)
def test_it_stays_close_to_the_float_matmul_of_the_dequantized_weight(fmt):
    weight = random_weight(fmt, 96, 576, seed=1)
    x = torch.randn(8, 576)
    exact = x @ quantized.dequantize(weight).T
    error = (quantized.quant_linear(x, weight) - exact).abs().max() / exact.abs().max()
    assert error < 0.02  # the activations' int8 rounding, a block at a time


@pytest.mark.parametrize("fmt", quantized.FORMATS)
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(fmt, lanes):
    weight = random_weight(fmt, 50, 128, seed=2)
    x = torch.randn(130, 128).bfloat16()
    whole = quantized.quant_linear(x, weight)
    for start, stop in [(0, 1), (5, 6), (3, 10), (60, 130), (129, 130)]:
        assert torch.equal(quantized.quant_linear(x[start:stop], weight), whole[start:stop]), (start, stop)


def test_the_vnni_and_the_scalar_builds_give_the_same_bits():
    weights = {fmt: random_weight(fmt, 40, 96, seed=3) for fmt in quantized.FORMATS}
    x = torch.randn(9, 96)
    results = {}
    with pytest.MonkeyPatch.context() as patch:
        for lanes in ("8", "16"):
            patch.setenv("INFLIGHT_CPU_KERNEL_LANES", lanes)
            cpu_kernels.load.cache_clear()
            results[lanes] = {fmt: (quantized.quant_linear(x, w), quantized.quant_linear(x.bfloat16(), w))
                              for fmt, w in weights.items()}
    cpu_kernels.load.cache_clear()
    for fmt in quantized.FORMATS:
        for got, want in zip(results["8"][fmt], results["16"][fmt]):
            assert torch.equal(got, want), fmt


@pytest.mark.parametrize("fmt", quantized.FORMATS)
def test_float32_logits_from_bfloat16_activations_are_the_unrounded_sums(fmt):
    weight = random_weight(fmt, 64, 64, seed=4)
    x = torch.randn(3, 64).bfloat16()
    logits = quantized.quant_linear(x, weight, out_dtype=torch.float32)
    assert logits.dtype is torch.float32
    assert torch.equal(logits.bfloat16(), quantized.quant_linear(x, weight))
    torch.testing.assert_close(logits, quantized.reference_linear(x, weight), rtol=1e-5, atol=1e-5)


def test_writing_into_a_column_slice_of_a_wider_output():
    weight = random_weight("q4", 32, 64, seed=5)
    x = torch.randn(4, 64)
    out = torch.zeros(4, 80)
    quantized.quant_linear(x, weight, out=out[:, 16:48])
    assert torch.equal(out[:, 16:48], quantized.quant_linear(x, weight))
    assert not out[:, :16].any() and not out[:, 48:].any()


@pytest.mark.parametrize("fmt", quantized.FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_rows_are_the_dequantized_rows(fmt, dtype):
    weight = random_weight(fmt, 100, 64, seed=6)
    ids = torch.tensor([0, 99, 17, 17, 64])
    assert torch.equal(quantized.quant_rows(weight, ids, dtype), quantized.dequantize(weight, dtype)[ids])
    with pytest.raises(ValueError, match="ids"):
        quantized.quant_rows(weight, torch.tensor([100]), dtype)


def test_bad_shapes_are_refused_with_the_argument_named():
    with pytest.raises(ValueError, match="in_features"):
        quantized.pack_q4(torch.zeros(16, 40, dtype=torch.uint8), torch.zeros(16, 1), torch.zeros(16, 1))
    with pytest.raises(ValueError, match="scale"):
        quantized.pack_q8(torch.zeros(16, 64, dtype=torch.int8), torch.zeros(16, 1))
