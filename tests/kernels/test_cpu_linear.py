"""kernels.cpu_kernels.linear, the decode-sized matmul, against oneDNN's packed matmul bit for bit.

The engine runs a linear of up to ``cpu_packing.kernel_rows()`` rows through this kernel and larger ones through
oneDNN (engine/models/cpu_packing.py). A sequence's tokens must not depend on how many others shared its step,
so the kernel has to give exactly oneDNN's bits: ``torch.equal``, not a tolerance. F.linear on the plain weight
is the independent reference for the values.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inflight.kernels import cpu_kernels

if cpu_kernels.load() is None:
    pytest.skip("the CPU kernels did not build here (no C++ compiler, or INFLIGHT_CPU_KERNELS=0)",
                allow_module_level=True)
if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
    pytest.skip("this torch has no oneDNN linear to compare with", allow_module_level=True)

ROWS = [1, 2, 3, 4, 5, 7, 13, 16]  # whole groups of the kernel's 4 rows, and the rows left after them


def onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# in_features: one chain of FMAs (<= 512), two blocks of 512 (<= 1024); out_features: whole blocks of 64 columns,
# and a last block the packed weight pads with zeros
@pytest.mark.parametrize("in_features,out_features", [(64, 96), (256, 512), (100, 37), (688, 256), (1000, 130)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_gives_onednn_bits_up_to_1024_inputs(in_features, out_features, bias, lanes):
    torch.manual_seed(in_features + out_features)
    weight = torch.randn(out_features, in_features) * 0.05
    b = torch.randn(out_features) if bias else None
    packed = cpu_kernels.pack_linear(weight)
    x = torch.randn(max(ROWS), in_features)
    for rows in ROWS:
        got = cpu_kernels.linear(x[:rows], packed, b, out_features)
        assert got.shape == (rows, out_features)
        assert torch.equal(got, onednn(x[:rows], weight, b)), f"{rows} rows"
        torch.testing.assert_close(got, F.linear(x[:rows], weight, b), rtol=1e-5, atol=1e-5)
    # a row's bits do not depend on the rows beside it, here or in oneDNN's larger batches
    assert torch.equal(cpu_kernels.linear(x[5:6], packed, b, out_features), onednn(x, weight, b)[5:6])


@pytest.mark.parametrize("in_features", [1376, 2048])
def test_a_lone_row_gets_onednn_bits_above_1024_inputs(in_features, lanes):
    """Above 1,024 inputs oneDNN sums a lone row on one thread in blocks of 512, as the kernel does (a batch
    another way, and with more threads it may split the inputs between them). The engine decodes a lone row on one
    thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(in_features)
        weight = torch.randn(96, in_features) * 0.05
        x = torch.randn(1, in_features)
        got = cpu_kernels.linear(x, cpu_kernels.pack_linear(weight), None, 96)
        assert torch.equal(got, onednn(x, weight, None))
    finally:
        torch.set_num_threads(before)


def test_the_build_says_how_many_rows_the_kernel_takes(lanes):
    """With FMA instructions: 16 rows with 16 lanes (4 rows share a read), 8 with 8 (a row a read); without, none:
    a software FMA is ~60x slower."""
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "").split()
    assert cpu_kernels.linear_max_rows() == ((16 if lanes == 16 else 8) if "fma" in flags else 0)


def test_a_bias_or_width_that_does_not_fit_is_refused():
    packed = cpu_kernels.pack_linear(torch.randn(70, 48))
    x = torch.randn(2, 48)
    with pytest.raises(AssertionError, match="out_features"):
        cpu_kernels.linear(x, packed, None, 129)  # the packed weight holds 2 blocks of 64 columns
    with pytest.raises(AssertionError, match="bias"):
        cpu_kernels.linear(x, packed, torch.randn(69), 70)


def test_rows_may_be_a_strided_view_and_threads_change_no_bit():
    """The model passes views (a slice of a wider activation); two threads split the column blocks, each summed
    as one thread sums it."""
    torch.manual_seed(1)
    weight = torch.randn(4096, 256) * 0.05
    packed = cpu_kernels.pack_linear(weight)
    wide = torch.randn(3, 512)
    x = wide[:, 128:384]
    assert x.stride() == (512, 1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.linear(x, packed, None, 4096)
        torch.set_num_threads(2)
        two = cpu_kernels.linear(x, packed, None, 4096)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    assert torch.equal(one, onednn(x.contiguous(), weight, None))


def test_a_transposed_view_is_taken_as_its_values():
    torch.manual_seed(2)
    weight = torch.randn(70, 48) * 0.05
    x = torch.randn(48, 3).t()  # [3, 48], columns 3 apart
    assert x.stride(1) != 1
    got = cpu_kernels.linear(x, cpu_kernels.pack_linear(weight), None, 70)
    assert torch.equal(got, onednn(x.contiguous(), weight, None))
