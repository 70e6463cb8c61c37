"""The CPU pass that packs linear weights for oneDNN: same results as the plain weight, on the rows it serves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from inflight.engine.models import cpu_packing
from inflight.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_packing.packing_available(), reason="this torch has no oneDNN linear")
requires_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels did not build here")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 32, bias=True))


@pytest.mark.parametrize("rows", [1, 2, 13, 64, 2048])
def test_packed_linears_equal_plain_ones(rows):
    model = make_model()
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        want = model(x)
        assert cpu_packing.pack_linear_weights(model) == 2
        got = model(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@requires_kernels
def test_packed_paths_are_taken_for_every_row_count():
    """Packed copies that no longer match the weight show which path ran: the kernel's copy up to kernel_rows() rows
    (a lone decode row too), oneDNN's above; never the plain weight."""
    model = make_model()
    layer = model[0]
    with torch.inference_mode():
        cpu_packing.pack_linear_weights(model)
        plain_weight = layer.weight.clone()
        layer.weight.zero_()  # the packed copies keep the old values
        for rows in (1, 2, cpu_packing.kernel_rows(), cpu_packing.kernel_rows() + 1, 2048):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(layer(x), F.linear(x, plain_weight), rtol=1e-5, atol=1e-5)
        layer.kernel_weight.zero_()
        assert not layer(torch.randn(cpu_packing.kernel_rows(), 64)).any()
        assert layer(torch.randn(cpu_packing.kernel_rows() + 1, 64)).abs().sum() > 0


@requires_kernels
def test_decode_rows_go_through_the_kernel():
    assert cpu_packing.kernel_rows() == cpu_kernels.linear_max_rows() >= 8  # (0 only without FMA instructions)
    model = make_model()
    with torch.inference_mode():
        cpu_packing.pack_linear_weights(model)
    assert [layer.kernel_rows for layer in model] == [cpu_packing.kernel_rows()] * 2


@requires_kernels
def test_a_single_output_stays_with_onednn():
    """oneDNN sums a linear with one output another way than the kernel: it keeps every row count."""
    layer = nn.Linear(64, 1)
    with torch.inference_mode():
        cpu_packing.pack_linear_weights(layer)
        x = torch.randn(3, 64)
        assert torch.equal(layer(x[:1]), layer(x)[:1])
    assert layer.kernel_rows == 0 and not hasattr(layer, "kernel_weight")


def test_without_the_kernels_every_row_count_goes_to_onednn(monkeypatch):
    """No compiler, a failed build or INFLIGHT_CPU_KERNELS=0: oneDNN's copy serves every row, a lone one too."""
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    monkeypatch.setattr(cpu_packing, "KERNEL_ROWS", 16)  # an override cannot send rows to a kernel that is not there
    model = make_model()
    layer = model[0]
    with torch.inference_mode():
        cpu_packing.pack_linear_weights(model)
        assert [m.kernel_rows for m in model] == [0, 0] and not hasattr(layer, "kernel_weight")
        plain_weight = layer.weight.clone()
        layer.weight.zero_()  # oneDNN's copy keeps the old values
        for rows in (1, 2, 17):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(layer(x), F.linear(x, plain_weight), rtol=1e-5, atol=1e-5)


@requires_kernels
def test_only_a_lone_row_goes_through_the_kernel_above_1024_inputs():
    """There oneDNN gives a batch's rows other bits than a lone row, and the kernel has only the lone row's."""
    layer = nn.Linear(1376, 8, bias=False)
    with torch.inference_mode():
        cpu_packing.pack_linear_weights(layer)
        x = torch.randn(3, 1376)
        alone = torch.ops.mkldnn._linear_pointwise(x[:1], layer.packed_weight, None, "none", [], "")
        batch = torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, None, "none", [], "")
        assert torch.equal(layer(x[:1]), alone) and torch.equal(layer(x), batch)
    assert layer.kernel_rows == 1


@pytest.mark.parametrize("batch", [13, 64])
def test_a_row_alone_gets_the_bits_it_gets_beside_others(batch):
    """One decode row, then the same row in a batch of 13 (the kernel) or 64 (oneDNN): the same bits, so a
    sequence's tokens do not depend on how many others shared its steps."""
    model = make_model()
    x = torch.randn(batch, 64)
    with torch.inference_mode():
        cpu_packing.pack_linear_weights(model)
        assert torch.equal(model(x[:1]), model(x)[:1])


def test_only_float32_and_bfloat16_cpu_linears_are_packed():
    model = make_model()
    model[1].to(torch.float16)
    with torch.inference_mode():
        assert cpu_packing.pack_linear_weights(model) == 1
    assert hasattr(model[0], "packed_weight") and not hasattr(model[1], "packed_weight")


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 300])
def test_bfloat16_linears_give_the_matmul_at_every_row_count(rows):
    """Kernel rows (up to kernel_rows()) and oneDNN's bf16 matmul above: both the float32 product of the bfloat16
    operands, rounded once (so within bfloat16's precision of the exact result)."""
    linear = nn.Linear(576, 1536, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    want = x.double() @ linear.weight.double().T + linear.bias.double()
    with torch.inference_mode():
        assert cpu_packing.pack_linear_weights(linear) == 1
        got = linear(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 1536)
    torch.testing.assert_close(got.double(), want, atol=0.02, rtol=2 ** -7)


def test_row_counts_are_padded_to_a_bounded_set_of_sizes():
    """oneDNN keeps a primitive per row count it sees: the padded sizes bound how many (and its memory)."""
    sizes = {cpu_packing.padded_rows(rows) for rows in range(2, 8193)}
    assert len(sizes) <= 200
    for rows in range(2, 8193):
        padded = cpu_packing.padded_rows(rows)
        assert rows <= padded <= rows * 17 / 16 and (rows > cpu_packing.EXACT_ROWS or padded == rows)


@pytest.mark.parametrize("rows", [33, 67, 300, 777, 2047])
def test_a_padded_row_count_gives_each_row_the_same_bits(rows):
    """A row's result does not depend on the padding rows beside it, bit for bit (exactness across batch sizes
    and continuations depends on it)."""
    model = make_model()
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        cpu_packing.pack_linear_weights(model)
        layer = model[0]
        alone = torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, None, "none", [], "")
        assert cpu_packing.padded_rows(rows) != rows
        assert torch.equal(layer(x), alone)


def test_engine_pads_a_forward_once_and_drops_the_padding(checkpoint):
    """The engine's model pads a prefill chunk's tokens to their bucket once (not at every linear): the real
    tokens' hidden states are bit for bit those of a forward without padding, and greedy decoding after
    unbucketed prompts of 45 and 300 tokens gives transformers' tokens."""
    from tests.checkpoints import hf_greedy
    from tests.engine.helpers import generate_ids, greedy, make_engine, random_prompts

    path = checkpoint("llama")
    engine = make_engine(path, max_num_batched_tokens=512, block_size=16, num_kv_blocks=64)
    model = engine.runner.model
    assert model.row_padding is cpu_packing.padded_rows
    prompts = [random_prompts(1, 45, 45, seed=1)[0], random_prompts(1, 300, 300, seed=2)[0]]
    assert all(cpu_packing.padded_rows(len(p)) != len(p) for p in prompts)
    assert generate_ids(engine, prompts, greedy(5)) == [hf_greedy(path, p, 5) for p in prompts]

    calls: list[int] = []
    first = model.model.layers[0].self_attn.qkv_proj
    hook = first.register_forward_pre_hook(lambda _module, args: calls.append(args[0].shape[0]))
    ids = torch.tensor(prompts[0])
    with torch.inference_mode():
        padded = model(ids, torch.arange(len(ids)), None, _dense_metadata(len(ids)))
        model.row_padding = None
        plain = model(ids, torch.arange(len(ids)), None, _dense_metadata(len(ids)))
    hook.remove()
    assert calls == [cpu_packing.padded_rows(45), 45]  # the linears saw the bucket, then the plain count
    assert padded.shape == plain.shape == (45, model.config.hidden_size) and torch.equal(padded, plain)


def _dense_metadata(num_tokens: int):
    from inflight.kernels.dense_prefill import DensePrefillMetadata

    return DensePrefillMetadata([num_tokens])
