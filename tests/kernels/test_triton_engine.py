"""The whole engine on the Triton backend (Triton's interpreter on a CPU) gives the torch backend's tokens.

Batches mix decodes, fresh prefills and prefill chunks after cached context (a small token budget
forces chunking), with block tables that are not contiguous, so every kernel path runs in a real step.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.engine.helpers import generate_ids, greedy, make_engine, random_prompts  # noqa: E402

ARGS = dict(block_size=16, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=48, dtype="float32")


@pytest.mark.slow
def test_triton_backend_greedy_tokens_equal_torch_backend():
    prompts = random_prompts(6, 3, 70, seed=4)
    params = [greedy(max_tokens=n) for n in (12, 3, 20, 7, 1, 15)]
    torch_ids = generate_ids(make_engine(attention_backend="torch", **ARGS), prompts, params)
    engine = make_engine(attention_backend="triton", **ARGS)
    assert engine.runner.backend.name == "triton"
    triton_ids = generate_ids(engine, prompts, params)
    assert triton_ids == torch_ids
    assert [len(ids) for ids in triton_ids] == [12, 3, 20, 7, 1, 15]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_cuda_graph_decode_gives_the_eager_tokens():
    """Decode steps replayed from captured graphs (batch sizes padded up to a bucket, rows joining and
    leaving) produce exactly the tokens of eager steps."""
    prompts = random_prompts(7, 3, 70, seed=5)
    params = [greedy(max_tokens=n) for n in (30, 3, 17, 9, 1, 25, 12)]
    args = {**ARGS, "max_num_seqs": 6, "num_kv_blocks": 128}
    eager = generate_ids(make_engine(attention_backend="triton", enforce_eager=True, **args), prompts, params)
    engine = make_engine(attention_backend="triton", **args)
    assert engine.runner.graphs is not None and engine.runner.graphs.sizes == [1, 2, 4, 6]
    assert generate_ids(engine, prompts, params) == eager
