"""engine.models.config's registry: every architecture it names loads (the vs-transformers tests run each family,
tests/checkpoints.ARCHITECTURES); an unknown one is refused listing the supported ones; a mixture-of-experts config
says which layers route to experts, and which layers slide over a window with which RoPE, read as transformers reads
them."""

from __future__ import annotations

import pytest

from inflight.engine.models.config import FAMILIES, ModelConfig
from tests.checkpoints import hf_config

NAMES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
         "mixtral": "MixtralForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def config_of(arch: str, **overrides) -> ModelConfig:
    return ModelConfig.from_hf({**hf_config(arch, **overrides).to_dict(), "architectures": [NAMES[arch]]})


def test_the_registry_is_what_the_tests_run():
    assert set(FAMILIES) == set(NAMES.values())


def test_an_unknown_architecture_is_refused_with_the_supported_ones():
    with pytest.raises(ValueError, match=r"model architecture 'GemmaForCausalLM' is not supported; supported: "
                                         r"LlamaForCausalLM, .*Qwen3MoeForCausalLM, Gemma2ForCausalLM, "
                                         r"Gemma3ForCausalLM"):
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


def test_sliding_layers_as_transformers_places_them():
    """``layer_types`` where the file has it (transformers >= 5 writes it), else each family's rule."""
    assert config_of("gemma2", num_hidden_layers=4).sliding_layers == (0, 2)  # every other layer, from the first
    gemma3 = config_of("gemma3", num_hidden_layers=12, layer_types=None)
    assert gemma3.sliding_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)  # five of each six
    assert config_of("mistral", num_hidden_layers=3).sliding_layers == (0, 1, 2)  # all
    qwen = config_of("qwen2", num_hidden_layers=4, max_window_layers=3)
    assert qwen.sliding_layers == (3,) and qwen.window(3) == 8 and qwen.window(2) is None
    assert config_of("qwen2", use_sliding_window=False).sliding_window is None  # the window needs its flag
    assert config_of("qwen3").sliding_window is None  # (use_sliding_window defaults to false)
    raw = {**hf_config("gemma2", num_hidden_layers=4).to_dict(), "architectures": ["Gemma2ForCausalLM"]}
    raw.pop("layer_types")  # a file written before transformers listed them: the family's pattern
    assert ModelConfig.from_hf(raw).sliding_layers == (0, 2)
    with pytest.raises(ValueError, match="layer_types must name full_attention or sliding_attention"):
        config_of("gemma2", layer_types=["sliding_attention", "chunked_attention"])


def test_gemma3_rotates_sliding_layers_by_their_own_rope():
    """Gemma 3's sliding layers turn at rope_local_base_freq, unscaled; its full layers at rope_theta, scaled: read
    from transformers 5's per-layer-type rope_parameters or from the older flat keys."""
    new = config_of("gemma3")
    assert new.sliding_rope == (1e4, None)
    assert (new.rope_theta, new.rope_scaling) == (1e6, {"factor": 2.0, "rope_type": "linear"})
    old = {**hf_config("gemma3").to_dict(), "architectures": ["Gemma3ForCausalLM"]}
    del old["rope_parameters"]
    old.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 2.0})
    parsed = ModelConfig.from_hf(old)
    assert (parsed.rope_theta, parsed.rope_scaling, parsed.sliding_rope) == (new.rope_theta, new.rope_scaling,
                                                                             new.sliding_rope)
    assert config_of("gemma2").sliding_rope is None  # one RoPE for every layer


def test_gemma_reads_its_scale_caps_and_activation():
    gemma2, gemma3 = config_of("gemma2"), config_of("gemma3")
    assert gemma2.attention_scale == gemma3.attention_scale == 24 ** -0.5  # query_pre_attn_scalar, not head_dim
    assert (gemma2.attention_softcap, gemma2.final_softcap) == (10.0, 8.0)
    assert gemma3.attention_softcap is None  # (Gemma 3's attention ignores attn_logit_softcapping)
    assert gemma2.gemma and gemma2.hidden_act == "gelu_tanh" and not config_of("llama").gemma
    with pytest.raises(ValueError, match="hidden activation 'gelu' is not supported for Gemma2ForCausalLM"):
        config_of("gemma2", hidden_activation="gelu")
    with pytest.raises(ValueError, match="hidden activation 'gelu_pytorch_tanh' is not supported for Llama"):
        config_of("llama", hidden_act="gelu_pytorch_tanh")
