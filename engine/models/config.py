"""The model's shape, read once from a Hugging Face ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: bias on q/k/v only; Llama/Qwen3 attention_bias: on q/k/v and o
    o_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm on each head of q and k before RoPE
    sliding_window: int | None
    torch_dtype: str | None

    @property
    def num_parameters(self) -> int:
        """Weights of the decoder (embeddings, attention, MLP, norms, head; biases and q/k norms too)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        attention += (q + 2 * kv if self.qkv_bias else 0) + (self.hidden_size if self.o_bias else 0)
        attention += 2 * self.head_dim if self.qk_norm else 0
        layer = attention + 3 * self.hidden_size * self.intermediate_size + 2 * self.hidden_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.vocab_size * self.hidden_size + self.num_layers * layer + self.hidden_size + head

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        architectures = hf.get("architectures") or []
        arch = architectures[0] if architectures else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"model architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias=True checkpoints are not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf.get('hidden_act')!r} is not supported (only silu)")
        num_heads = hf["num_attention_heads"]
        # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        attention_bias = bool(hf.get("attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        sliding_window = hf.get("sliding_window")
        if is_qwen2 and not hf.get("use_sliding_window", False):
            sliding_window = None
        dtype = hf.get("dtype") or hf.get("torch_dtype")
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_window=sliding_window,
            torch_dtype=str(dtype).replace("torch.", "") if dtype else None,
        )
