"""engine.models.config's registry: every architecture it names loads (the vs-transformers tests run each family,
tests/checkpoints.ARCHITECTURES); an unknown one is refused listing the supported ones; a mixture-of-experts config
says which layers route to experts, read as transformers reads it."""

from __future__ import annotations

import pytest

from inflight.engine.models.config import FAMILIES, ModelConfig
from tests.checkpoints import hf_config

NAMES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
         "mixtral": "MixtralForCausalLM"}


def config_of(arch: str, **overrides) -> ModelConfig:
    return ModelConfig.from_hf({**hf_config(arch, **overrides).to_dict(), "architectures": [NAMES[arch]]})


def test_the_registry_is_what_the_tests_run():
    assert set(FAMILIES) == set(NAMES.values())


def test_an_unknown_architecture_is_refused_with_the_supported_ones():
    with pytest.raises(ValueError, match=r"model architecture 'GemmaForCausalLM' is not supported; supported: "
                                         r"LlamaForCausalLM, .*MixtralForCausalLM, Qwen3MoeForCausalLM"):
        ModelConfig.from_hf({**hf_config("llama").to_dict(), "architectures": ["GemmaForCausalLM"]})


def test_experts_layers_as_transformers_places_them():
    mixtral = config_of("mixtral")
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_layers) == (4, 2, (0, 1))
    assert mixtral.moe_intermediate_size == mixtral.intermediate_size and mixtral.norm_topk_prob
    qwen = config_of("qwen3_moe", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    assert qwen.moe_layers == (1, 5) and qwen.moe_intermediate_size == 48  # (i + 1) % 2 == 0, but layer 3
    # Qwen's own config.json says num_experts (transformers >= 5 writes num_local_experts): either is read
    raw = {**hf_config("qwen3_moe").to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}
    raw["num_experts"] = raw.pop("num_local_experts", None) or raw.pop("num_experts")
    assert ModelConfig.from_hf(raw).num_experts == 8
    assert config_of("qwen3").num_experts == 0 and config_of("qwen3").moe_layers == ()
    # every expert's weights are counted: 8 x 3 x 64 x 48 plus the router's 8 x 64, in the one MoE layer
    assert config_of("qwen3_moe").num_parameters - config_of("qwen3").num_parameters == \
        8 * (3 * 64 * 48 + 64) - 3 * 64 * 160


def test_rope_on_part_of_each_head_is_refused():
    raw = {**hf_config("phi3").to_dict(), "architectures": ["Phi3ForCausalLM"]}
    raw["rope_parameters"] = {**(raw.get("rope_parameters") or {}), "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig.from_hf(raw)


def test_experts_are_cut_over_ranks_as_the_dense_mlp():
    from inflight.engine.models.tensor_parallel import Shard, check_tensor_parallel_size

    cfg = config_of("mixtral")
    check_tensor_parallel_size(cfg, 2)
    shards = [Shard.of(cfg, rank, 2) for rank in range(2)]
    assert [(s.first_expert_intermediate, s.expert_intermediate) for s in shards] == [(0, 80), (80, 80)]
    with pytest.raises(ValueError, match="experts' intermediate size 48"):
        check_tensor_parallel_size(config_of("qwen3_moe", num_attention_heads=64, num_key_value_heads=64,
                                             head_dim=1), 64)
