"""engine.models.tensor_parallel: a model cut over two ranks (two processes, the CPU's two cores) computes what
the whole model computes: the same logits up to float32 summation, the same greedy tokens (the ranks' sums go through
``engine.parallel.collectives``' shared memory, as in the engine).

Checkpoints: Llama with its KV heads split evenly (4 query / 2 KV heads: one each), Llama with one KV head
(replicated on both ranks), Qwen3 (q/k norms, head_dim apart from hidden / heads), Qwen2 (a qkv bias, tied
embeddings, an odd vocabulary: 263 rows padded to 2 x 132), Llama with 3 KV heads dealt unevenly (1 and 2). Each rank loads the whole checkpoint and keeps its
share; the prompt is computed whole (no KV cache), then greedily extended by recomputing, so the test holds the
model's math alone, not the engine's."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from inflight.engine.models.tensor_parallel import Shard, check_tensor_parallel_size, sizes_allowed
from tests.checkpoints import hf_config

CASES = {
    "llama-even": ("llama", {"hidden_size": 128}),
    "llama-one-kv-head": ("llama", {"hidden_size": 128, "num_key_value_heads": 1}),
    "qwen3": ("qwen3", {}),
    "qwen2-bias-tied": ("qwen2", {}),
    "llama-uneven": ("llama", {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3}),
    "mixtral": ("mixtral", {}),
    "qwen3-moe": ("qwen3_moe", {}),
    "gemma2": ("gemma2", {}),  # (its windows a mask under tensor parallelism: every layer's KV whole)
    "gemma3": ("gemma3", {}),
}
PROMPT = [5, 17, 200, 33, 41, 99, 150, 7, 64, 128, 3, 250]
NEW_TOKENS = 6


def config_of(arch: str, **overrides):
    from inflight.engine.models.config import ModelConfig

    names = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
             "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
    return ModelConfig.from_hf({**hf_config(arch, **overrides).to_dict(), "architectures": [names[arch]]})


def test_sizes_that_do_not_divide_the_model_are_refused_with_the_sizes_it_allows():
    cfg = config_of("llama", num_attention_heads=6, num_key_value_heads=2, hidden_size=96, intermediate_size=192)
    assert sizes_allowed(cfg, up_to=8) == [1, 2, 6]
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 4 cannot cut the model's 2 KV heads of 3 query heads "
                                         r"each.*allows 1, 2, 6"):
        check_tensor_parallel_size(cfg, 4)
    # SmolLM2-135M's shape: 9 query heads on 3 KV heads
    smol = config_of("llama", num_attention_heads=9, num_key_value_heads=3, hidden_size=576, intermediate_size=1536)
    assert sizes_allowed(smol, up_to=16) == [1, 2, 3, 9]
    with pytest.raises(ValueError, match="tensor_parallel_size: must be a positive integer"):
        check_tensor_parallel_size(cfg, 0)


def test_each_rank_holds_its_heads_and_the_kv_head_they_read():
    cfg = config_of("llama", num_attention_heads=8, num_key_value_heads=2, hidden_size=128)
    shards = [Shard.of(cfg, rank, 4) for rank in range(4)]
    assert [(s.heads, s.first_kv_head, s.kv_heads) for s in shards] == [(2, 0, 1), (2, 0, 1), (2, 1, 1), (2, 1, 1)]
    # query heads 0-3 read KV head 0 and 4-7 KV head 1 (groups of 4): ranks 0-1 and 2-3
    assert [Shard.of(cfg, r, 2).first_kv_head for r in range(2)] == [0, 1]
    # uneven: 3 KV heads on 2 ranks go 1 and 2, each with its 3 query heads; the MLP's width evens out the weights
    cfg = config_of("llama", num_attention_heads=9, num_key_value_heads=3, hidden_size=144, intermediate_size=160)
    shards = [Shard.of(cfg, rank, 2) for rank in range(2)]
    assert [(s.first_head, s.heads, s.first_kv_head, s.kv_heads) for s in shards] == [(0, 3, 0, 1), (3, 6, 1, 2)]
    assert [(s.first_intermediate, s.intermediate) for s in shards] == [(0, 101), (101, 59)]
    hd, hidden = cfg.head_dim, cfg.hidden_size
    weights = [(2 * s.heads + 2 * s.kv_heads) * hd * hidden + 3 * s.intermediate * hidden for s in shards]
    assert abs(weights[0] - weights[1]) <= 3 * hidden  # within one intermediate row (evenly: 18,432 apart)
    # even heads: the MLP halves, in multiples of 32
    cfg = config_of("llama", num_attention_heads=8, num_key_value_heads=4, hidden_size=128, intermediate_size=384)
    assert [Shard.of(cfg, rank, 2).intermediate for rank in range(2)] == [192, 192]


def _rank_main(rank: int, size: int, region: str, checkpoints: dict, out_dir: str) -> None:
    """One rank: join the group, and for every checkpoint cut the model and run the prompt greedily."""
    from inflight.engine.models.loader import build_model
    from inflight.engine.models.source import read_model_source
    from inflight.engine.models.tensor_parallel import Shard, shard_model
    from inflight.engine.parallel.collectives import ShmCollectives
    from inflight.kernels import get_attention_backend
    from inflight.kernels.dense_prefill import DensePrefillMetadata

    torch.set_num_threads(1)
    comm = ShmCollectives.attach(region, rank, size)
    try:
        for name, path in checkpoints.items():
            source = read_model_source(path)
            backend = get_attention_backend("torch", torch.device("cpu"), torch.float32)
            model = build_model(source, backend, 512, torch.float32, torch.device("cpu"))
            if size > 1:
                shard_model(model, Shard.of(source.config, rank, size), comm)
            tokens, logits = list(PROMPT), []
            with torch.no_grad():
                for _ in range(NEW_TOKENS):
                    ids = torch.tensor(tokens)
                    hidden = model(ids, torch.arange(len(tokens)), None, DensePrefillMetadata([len(tokens)]))
                    rows = model.compute_logits(hidden[-1:])  # on rank 0; the others get None
                    token = torch.tensor([int(rows[0].argmax()) if rows is not None else -1])
                    if size > 1:
                        comm.broadcast(token)  # rank 0's choice, as the engine's sampler's
                    if rows is not None:
                        logits.append(rows[0])
                    tokens.append(int(token))
            if rank == 0:
                torch.save({"tokens": tokens, "logits": torch.stack(logits)}, os.path.join(out_dir, f"{name}.pt"))
    finally:
        comm.close()


def _run(size: int, checkpoints: dict, out_dir) -> dict:
    import torch.multiprocessing as mp

    from inflight.engine.parallel.collectives import ShmCollectives

    os.makedirs(out_dir, exist_ok=True)
    owner = ShmCollectives.create(size)
    try:
        # spawn, never fork: a forked gloo or OpenMP runtime deadlocks inside a large pytest process
        mp.start_processes(_rank_main, args=(size, owner.region.name, checkpoints, str(out_dir)), nprocs=size,
                           start_method="spawn")
    finally:
        owner.close()
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


@pytest.mark.parametrize("name", CASES)
def test_a_rank_loads_only_its_part_and_it_is_the_whole_models_cut(checkpoint, name):
    """Loading with a shard cuts the module before it is allocated and each checkpoint tensor as it is read: the same
    weights as cutting the whole loaded model, and about half of them on each of two ranks."""
    from inflight.engine.models.loader import build_model
    from inflight.engine.models.source import read_model_source
    from inflight.engine.models.tensor_parallel import shard_model
    from inflight.kernels import get_attention_backend

    arch, overrides = CASES[name]
    source = read_model_source(str(checkpoint(arch, **overrides)))
    backend = get_attention_backend("torch", torch.device("cpu"), torch.float32)

    def build(shard=None):
        return build_model(source, backend, 512, torch.float32, torch.device("cpu"), shard=shard)

    whole = sum(p.numel() for p in build().parameters())
    for rank in range(2):
        shard = Shard.of(source.config, rank, 2)
        loaded = dict(build(shard).named_parameters())
        cut = dict(shard_model(build(), shard, None).named_parameters())
        assert loaded.keys() == cut.keys()
        for key in loaded:
            assert torch.equal(loaded[key], cut[key]), (name, rank, key)
        assert sum(p.numel() for p in loaded.values()) < 0.65 * whole
