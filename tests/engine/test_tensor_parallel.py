"""engine.models.tensor_parallel: a model cut over two ranks (two processes, gloo, the CPU's two cores) computes what
the whole model computes: the same logits up to float32 summation, the same greedy tokens.

Checkpoints: Llama with its KV heads split evenly (4 query / 2 KV heads: one each), Llama with one KV head
(replicated on both ranks), Qwen3 (q/k norms, head_dim apart from hidden / heads), Qwen2 (a qkv bias, tied
embeddings, an odd vocabulary: 263 rows padded to 2 x 132). Each rank loads the whole checkpoint and keeps its
share; the prompt is computed whole (no KV cache), then greedily extended by recomputing, so the test holds the
model's math alone, not the engine's."""

from __future__ import annotations

import dataclasses
import os
import socket

import pytest
import torch

from inflight.engine.models.tensor_parallel import Shard, check_tensor_parallel_size, sizes_allowed
from tests.checkpoints import hf_config

CASES = {
    "llama-even": ("llama", {"hidden_size": 128}),
    "llama-one-kv-head": ("llama", {"hidden_size": 128, "num_key_value_heads": 1}),
    "qwen3": ("qwen3", {}),
    "qwen2-bias-tied": ("qwen2", {}),
}
PROMPT = [5, 17, 200, 33, 41, 99, 150, 7, 64, 128, 3, 250]
NEW_TOKENS = 6


def config_of(arch: str, **overrides):
    from inflight.engine.models.config import ModelConfig

    names = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    return ModelConfig.from_hf({**hf_config(arch, **overrides).to_dict(), "architectures": [names[arch]]})


def test_sizes_that_do_not_divide_the_model_are_refused_with_the_sizes_it_allows():
    cfg = config_of("llama", num_attention_heads=6, num_key_value_heads=2, hidden_size=96, intermediate_size=192)
    assert sizes_allowed(cfg, up_to=8) == [1, 2, 6]
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 4 does not divide the model's 6 query heads.*"
                                         r"allows 1, 2, 6"):
        check_tensor_parallel_size(cfg, 4)
    with pytest.raises(ValueError, match="tensor_parallel_size: must be a positive integer"):
        check_tensor_parallel_size(cfg, 0)


def test_each_rank_holds_its_heads_and_the_kv_head_they_read():
    cfg = config_of("llama", num_attention_heads=8, num_key_value_heads=2, hidden_size=128)
    shards = [Shard.of(cfg, rank, 4) for rank in range(4)]
    assert [(s.heads, s.first_kv_head, s.kv_heads) for s in shards] == [(2, 0, 1), (2, 0, 1), (2, 1, 1), (2, 1, 1)]
    # query heads 0-3 read KV head 0 and 4-7 KV head 1 (groups of 4): ranks 0-1 and 2-3
    assert [Shard.of(cfg, r, 2).first_kv_head for r in range(2)] == [0, 1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, size: int, port: int, checkpoints: dict, out_dir: str) -> None:
    """One rank: join the group, and for every checkpoint cut the model and run the prompt greedily."""
    import torch.distributed as dist

    from inflight.engine.models.loader import build_model
    from inflight.engine.models.source import read_model_source
    from inflight.engine.models.tensor_parallel import Shard, shard_model
    from inflight.kernels import get_attention_backend
    from inflight.kernels.dense_prefill import DensePrefillMetadata

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        for name, path in checkpoints.items():
            source = read_model_source(path)
            backend = get_attention_backend("torch", torch.device("cpu"), torch.float32)
            model = build_model(source, backend, 512, torch.float32, torch.device("cpu"))
            if size > 1:
                shard_model(model, Shard.of(source.config, rank, size))
            tokens, logits = list(PROMPT), []
            with torch.no_grad():
                for _ in range(NEW_TOKENS):
                    ids = torch.tensor(tokens)
                    hidden = model(ids, torch.arange(len(tokens)), None, DensePrefillMetadata([len(tokens)]))
                    row = model.compute_logits(hidden[-1:])[0]
                    logits.append(row)
                    tokens.append(int(row.argmax()))
            if rank == 0:
                torch.save({"tokens": tokens, "logits": torch.stack(logits)}, os.path.join(out_dir, f"{name}.pt"))
    finally:
        dist.destroy_process_group()


def _run(size: int, checkpoints: dict, out_dir) -> dict:
    import torch.multiprocessing as mp

    os.makedirs(out_dir, exist_ok=True)
    # spawn, never fork: gloo deadlocks inside a large pytest process under fork
    mp.start_processes(_rank_main, args=(size, _free_port(), checkpoints, str(out_dir)), nprocs=size,
                       start_method="spawn")
    return {name: torch.load(os.path.join(out_dir, f"{name}.pt")) for name in checkpoints}


def test_two_ranks_compute_the_whole_models_logits_and_tokens(checkpoint, tmp_path):
    checkpoints = {name: str(checkpoint(arch, **overrides)) for name, (arch, overrides) in CASES.items()}
    whole = _run(1, checkpoints, tmp_path / "one")
    cut = _run(2, checkpoints, tmp_path / "two")
    for name in CASES:
        assert cut[name]["tokens"] == whole[name]["tokens"], name
        # float32 sums in another order (each rank's partial sums, then the all-reduce): ~1e-6 of the logits' size
        diff = (cut[name]["logits"] - whole[name]["logits"]).abs().max().item()
        assert diff <= 1e-5 * whole[name]["logits"].abs().max().item(), (name, diff)
        assert not torch.equal(whole[name]["logits"][0], whole[name]["logits"][1])  # (a prompt that moves)


def test_the_cut_is_a_frozen_record_of_what_each_rank_holds():
    cfg = config_of("qwen2")
    shard = Shard.of(cfg, 1, 2)
    assert shard.vocab_rows * 2 >= cfg.vocab_size and shard.intermediate * 2 == cfg.intermediate_size
    with pytest.raises(dataclasses.FrozenInstanceError):
        shard.rank = 0
    with pytest.raises(ValueError, match="rank"):
        Shard.of(cfg, 2, 2)
