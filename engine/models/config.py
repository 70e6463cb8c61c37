"""The model's shape, read once from a Hugging Face ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

@dataclass(frozen=True)
class Family:
    """What sets an architecture apart from Llama's decoder (engine/models/llama.py), read by ``from_hf``."""

    qkv_bias: bool = False  # q/k/v biases whatever attention_bias says (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head of q and k before RoPE (Qwen3)
    sliding_window_flag: str | None = None  # a config key that must be true for sliding_window to apply (Qwen2)
    moe: bool = False  # mixture of experts (Qwen3-MoE, Mixtral): num_experts or num_local_experts count them
    renormalizes_top_k: bool | None = None  # the chosen experts' weights made to sum 1; None: norm_topk_prob says


# The one registry: an architecture name (config.json's ``architectures``) -> its family.
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(),
    "Qwen2ForCausalLM": Family(qkv_bias=True, sliding_window_flag="use_sliding_window"),
    "Qwen3ForCausalLM": Family(qk_norm=True),
    "Phi3ForCausalLM": Family(),  # its files hold q/k/v and gate/up fused already, in our order
    "MixtralForCausalLM": Family(moe=True, renormalizes_top_k=True),
    "Qwen3MoeForCausalLM": Family(qk_norm=True, moe=True),
}


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
    # Mixture of experts (0 experts: every layer's MLP is dense): the layers whose MLP is ``num_experts`` experts of
    # ``moe_intermediate_size``, each token routed to its ``num_experts_per_tok`` best (their weights renormalized to
    # sum 1 where ``norm_topk_prob``); the other layers keep a dense MLP of ``intermediate_size``.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()

    @property
    def num_parameters(self) -> int:
        """Weights of the decoder (embeddings, attention, MLP, norms, head; biases and q/k norms too)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        attention += (q + 2 * kv if self.qkv_bias else 0) + (self.hidden_size if self.o_bias else 0)
        attention += 2 * self.head_dim if self.qk_norm else 0
        layer = attention + 2 * self.hidden_size
        dense = 3 * self.hidden_size * self.intermediate_size
        sparse = self.num_experts * (3 * self.hidden_size * self.moe_intermediate_size + self.hidden_size)
        mlps = len(self.moe_layers) * sparse + (self.num_layers - len(self.moe_layers)) * dense
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.vocab_size * self.hidden_size + self.num_layers * layer + mlps + self.hidden_size + head

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        architectures = hf.get("architectures") or []
        arch = architectures[0] if architectures else None
        if arch not in FAMILIES:
            raise ValueError(f"model architecture {arch!r} is not supported; supported: {', '.join(FAMILIES)}")
        family = FAMILIES[arch]
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias=True checkpoints are not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf.get('hidden_act')!r} is not supported (only silu)")
        num_heads = hf["num_attention_heads"]
        # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        if float(rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
            raise ValueError("partial_rotary_factor != 1 (RoPE on part of each head) is not supported")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        attention_bias = bool(hf.get("attention_bias", False))
        sliding_window = hf.get("sliding_window")
        if family.sliding_window_flag is not None and not hf.get(family.sliding_window_flag, False):
            sliding_window = None
        num_layers = hf["num_hidden_layers"]
        # (Qwen's own files say num_experts; transformers >= 5 writes num_local_experts for both families)
        num_experts = (hf.get("num_experts") or hf.get("num_local_experts") or 0) if family.moe else 0
        if num_experts:  # Mixtral: every layer; Qwen3-MoE: every decoder_sparse_step-th, but mlp_only_layers
            step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
            moe_layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        else:
            moe_layers = ()
        dtype = hf.get("dtype") or hf.get("torch_dtype")
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if family.qkv_bias else attention_bias,
            o_bias=False if family.qkv_bias else attention_bias,
            qk_norm=family.qk_norm,
            sliding_window=sliding_window,
            torch_dtype=str(dtype).replace("torch.", "") if dtype else None,
            num_experts=num_experts,
            num_experts_per_tok=hf.get("num_experts_per_tok", 0) if num_experts else 0,
            moe_intermediate_size=hf.get("moe_intermediate_size") or hf["intermediate_size"] if num_experts else 0,
            norm_topk_prob=(family.renormalizes_top_k if family.renormalizes_top_k is not None
                            else bool(hf.get("norm_topk_prob", False))) if num_experts else False,
            moe_layers=moe_layers,
        )
