"""Small random Hugging Face checkpoints, written with transformers (the test-time reference)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from inflight.engine.models.demo_tiny import CHAT_TEMPLATE, build_tokenizer

VOCAB_SIZE = 263  # demo-tiny's byte-level tokenizer
EOS_ID = 2

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "qwen3_moe", "mixtral", "gemma2", "gemma3")
SLIDING_WINDOW = 8  # Mistral's, Qwen2's and Gemma's: the tests' prompts are longer


def hf_config(arch: str, **overrides):
    import transformers

    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=0, initializer_range=0.3)
    if arch == "llama":
        common.update(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        cls = transformers.LlamaConfig
    elif arch == "mistral":
        cls = transformers.MistralConfig
        common.update(sliding_window=SLIDING_WINDOW)  # every layer slides
    elif arch == "qwen2":
        cls = transformers.Qwen2Config
        common.update(tie_word_embeddings=True, use_sliding_window=True, sliding_window=SLIDING_WINDOW,
                      max_window_layers=1)  # layer 1 slides
    elif arch == "qwen3":
        cls = transformers.Qwen3Config
        common.update(head_dim=32)  # Qwen3 sets head_dim apart from hidden / heads
    elif arch == "phi3":  # q/k/v and gate/up stored fused
        cls = transformers.Phi3Config
        common.update(sliding_window=None, pad_token_id=0)
    elif arch == "qwen3_moe":  # 8 experts, 2 a token, renormalized; layer 0 keeps a dense MLP (mlp_only_layers)
        cls = transformers.Qwen3MoeConfig
        common.update(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0])
    elif arch == "mixtral":  # 4 experts, 2 a token, in every layer
        cls = transformers.MixtralConfig
        common.update(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)
    # Gemma: untied (a tied head on x sqrt(hidden) embeddings of random weights predicts the last token forever)
    elif arch == "gemma2":  # layer 0 slides over 8 positions, layer 1 sees all; scores and logits soft-capped
        cls = transformers.Gemma2Config
        common.update(head_dim=32, sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=24, tie_word_embeddings=False,
                      attn_logit_softcapping=10.0, final_logit_softcapping=8.0, hidden_activation="gelu_pytorch_tanh")
    elif arch == "gemma3":  # sliding and full layers rotate by different RoPEs (the full ones' linearly scaled)
        cls = transformers.Gemma3TextConfig
        common.update(head_dim=32, sliding_window=SLIDING_WINDOW, query_pre_attn_scalar=24, tie_word_embeddings=False,
                      layer_types=["sliding_attention", "full_attention"],
                      rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    else:
        raise ValueError(arch)
    common.update(overrides)
    return cls(**common)


def make_checkpoint(path: Path, arch: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                    max_shard_size: str | None = None, **overrides) -> Path:
    """Write a random model of ``arch`` with demo-tiny's tokenizer to ``path``; returns ``path``."""
    import transformers

    torch.manual_seed(seed)
    config = hf_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    tokenizer = build_tokenizer()
    tokenizer._tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": CHAT_TEMPLATE}))
    return path


def hf_greedy(path: Path, prompt_ids: list[int], max_new_tokens: int, dtype: torch.dtype = torch.float32,
              **generation: float) -> list[int]:
    """transformers' own greedy generate, one request at a time (no padding), eos ignored; ``generation``: more
    ``GenerationConfig`` settings (``repetition_penalty``)."""
    import transformers

    model = hf_model(path, dtype)
    # eos_token_id=[] (not None): None falls back to the checkpoint's generation_config and stops at eos.
    config = transformers.GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=False,
                                           eos_token_id=[], pad_token_id=0, **generation)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), generation_config=config)
    tokens = out[0, len(prompt_ids):].tolist()
    assert len(tokens) == max_new_tokens, f"transformers stopped early: {tokens}"
    return tokens


def hf_logits(path: Path, token_ids: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """transformers' logits [len(token_ids), vocab] (float32) of one unpadded sequence."""
    with torch.no_grad():
        return hf_model(path, dtype)(torch.tensor([token_ids])).logits[0].float()


_models: dict[tuple[str, torch.dtype], object] = {}


def hf_model(path: Path | str, dtype: torch.dtype = torch.float32):
    """The checkpoint loaded by transformers, cached for the whole session."""
    import transformers

    key = (str(path), dtype)
    if key not in _models:
        _models[key] = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    return _models[key]

