"""kernels.triton_moe: a MoE layer's experts in two grouped-GEMM launches, against ``Experts.loop`` (the PyTorch loop
over experts) under Triton's interpreter on this CPU (tests/conftest.py sets TRITON_INTERPRET=1), and a whole engine
on a Mixtral checkpoint with the Triton backend giving the torch backend's tokens."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from inflight.engine.models.llama import Experts  # noqa: E402
from inflight.kernels import triton_moe  # noqa: E402
from tests.engine.helpers import generate_ids, greedy, make_engine, random_prompts  # noqa: E402


def test_tiles_cut_each_experts_rows_and_skip_the_unchosen():
    assert triton_moe.tiles([3, 0, 20, 16], block_m=16) == ([0, 2, 2, 3], [0, 3, 19, 23], [3, 19, 23, 39])
    assert triton_moe.tiles([0, 0]) == ([], [], [])


# counts: experts no row chose, one expert's rows over two tiles, widths and hiddens that are no block's multiple
@pytest.mark.parametrize("counts,hidden,width", [([3, 0, 20, 1], 72, 40), ([0, 0, 5, 0], 64, 64), ([17], 40, 24)])
def test_the_experts_equal_the_loop(counts, hidden, width):
    g = torch.Generator().manual_seed(sum(counts))
    experts = len(counts)
    gate_up = torch.randn(experts, 2 * width, hidden, generator=g) * hidden ** -0.5
    down = torch.randn(experts, hidden, width, generator=g) * width ** -0.5
    rows = torch.randn(sum(counts), hidden, generator=g)
    got = triton_moe.moe_experts(rows, counts, gate_up, down)
    torch.testing.assert_close(got, Experts.loop(rows, counts, gate_up, down), atol=1e-5, rtol=1e-4)


def test_a_row_out_of_its_experts_tile_is_never_written():
    """Each tile writes its own rows only: rows of an expert the counts leave out keep what the buffer had."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(2, 32, 16, generator=g)
    x = torch.randn(5, 16, generator=g)
    y = triton_moe.grouped_linear(x, weight, [2, 3])
    torch.testing.assert_close(y[:2], x[:2] @ weight[0].T, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(y[2:], x[2:] @ weight[1].T, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_a_mixtral_engine_on_the_triton_backend_gives_the_torch_backends_tokens(checkpoint):
    path = checkpoint("mixtral")
    args = dict(block_size=16, num_kv_blocks=32, max_num_seqs=3, max_num_batched_tokens=32)
    prompts, params = random_prompts(3, 5, 40, seed=8), [greedy(6), greedy(3), greedy(8)]
    engine = make_engine(path, attention_backend="triton", **args)
    assert all(m.kernel is not None for m in engine.runner.model.modules() if isinstance(m, Experts))
    assert generate_ids(engine, prompts, params) == generate_ids(make_engine(path, attention_backend="torch", **args),
                                                                 prompts, params)
