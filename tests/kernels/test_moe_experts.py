"""kernels.cpu_kernels.moe_experts (csrc/moe_experts.h) against the PyTorch loop over experts it replaces
(``engine.models.llama.Experts.loop``): float32 within float32 summation, bfloat16 within one rounding; experts with
no rows, one row, many; sizes that are not multiples of the vector width; and a pair's result independent of the
pairs beside it. Then an engine on a Mixtral checkpoint gives the same greedy tokens with the kernel and the loop."""

from __future__ import annotations

import pytest
import torch

from inflight.engine.models.llama import Experts
from inflight.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels are not built here")


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("hidden, inter, counts", [(64, 48, [3, 0, 5, 1, 0, 7, 2, 4]), (70, 50, [1]),
                                                   (96, 40, [0, 0, 33, 0])])
def test_the_kernel_is_the_loop_over_experts(dtype, tolerance, hidden, inter, counts):
    g = torch.Generator().manual_seed(hidden + inter)
    experts = len(counts)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * inter ** -0.5).to(dtype)
    rows = torch.randn(sum(counts), hidden, generator=g).to(dtype)
    fused = cpu_kernels.moe_experts(rows, counts, gate_up, down)
    loop = Experts.loop(rows, counts, gate_up, down)
    scale = loop.float().abs().max().item()
    assert (fused.float() - loop.float()).abs().max().item() <= tolerance * scale
    # each pair alone gives the same bits as in the batch (no dependence on the rows beside it)
    start = 0
    for expert, count in enumerate(counts):
        for r in range(start, start + count):
            alone = [0] * experts
            alone[expert] = 1
            assert torch.equal(cpu_kernels.moe_experts(rows[r:r + 1].contiguous(), alone, gate_up, down)[0],
                               fused[r])
        start += count


def test_an_engine_gives_the_same_tokens_with_the_kernel_and_the_loop(checkpoint):
    from inflight import LLM, SamplingParams

    path = checkpoint("mixtral")
    prompts = [{"prompt_token_ids": [(5 * i + 7 * j) % 250 + 3 for j in range(6 + 3 * i)]} for i in range(6)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    tokens = {}
    for path_kind in ("kernel", "loop"):
        llm = LLM(str(path), num_threads=1)
        experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, Experts)]
        assert experts and all(m.kernel is cpu_kernels.moe_experts for m in experts)
        if path_kind == "loop":
            for module in experts:
                module.kernel = None
        tokens[path_kind] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["kernel"] == tokens["loop"]
