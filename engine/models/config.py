"""The model's shape, read once from a Hugging Face ``config.json``."""

from __future__ import annotations

import math
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
    # Which layers slide when the config has a window and no ``layer_types``: "all"; "max_window_layers" (Qwen: those
    # from that index on); or every layer but each ``sliding_pattern``-th (Gemma: 2; Gemma 3's files may say another)
    sliding_layers: str = "all"
    sliding_pattern: int = 0
    gemma: bool = False  # Gemma's decoder: GELU-tanh, (1 + weight) norms, four norms a layer, embeddings x sqrt(hidden)
    attention_softcap: bool = False  # reads attn_logit_softcapping (Gemma 2; Gemma 3's attention ignores it)
    rope_theta: float = 10000.0  # where the config names none (Gemma 3's global layers: 1e6)
    longrope_names: tuple[str, ...] = ()  # older names of its rope_type for LongRoPE (Phi-3's "su" and "yarn")


# The one registry: an architecture name (config.json's ``architectures``) -> its family.
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(),
    "Qwen2ForCausalLM": Family(qkv_bias=True, sliding_window_flag="use_sliding_window",
                               sliding_layers="max_window_layers"),
    "Qwen3ForCausalLM": Family(qk_norm=True, sliding_window_flag="use_sliding_window", sliding_layers="max_window_layers"),
    "Phi3ForCausalLM": Family(longrope_names=("su", "yarn")),  # its files hold q/k/v and gate/up fused, our order
    "MixtralForCausalLM": Family(moe=True, renormalizes_top_k=True),
    "Qwen3MoeForCausalLM": Family(qk_norm=True, moe=True, sliding_window_flag="use_sliding_window"),
    "Gemma2ForCausalLM": Family(gemma=True, attention_softcap=True, sliding_layers="pattern", sliding_pattern=2),
    "Gemma3ForCausalLM": Family(qk_norm=True, gemma=True, sliding_layers="pattern", sliding_pattern=6,
                                rope_theta=1e6),
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
    # Sliding-window attention: these layers see only the last ``sliding_window`` positions (the query's own
    # included), and rotate by ``sliding_rope`` (theta, scaling) where it differs from the other layers' (Gemma 3).
    sliding_layers: tuple[int, ...] = ()
    sliding_rope: tuple[float, dict[str, Any] | None] | None = None
    attention_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attention_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the softmax (Gemma 2)
    final_softcap: float | None = None  # the logits so (Gemma 2)
    gemma: bool = False  # Family.gemma
    hidden_act: str = "silu"  # or "gelu_tanh" (Gemma)

    def window(self, layer: int) -> int | None:
        """How many positions layer ``layer`` attends to, back from the query's own (None: all)."""
        return self.sliding_window if layer in self.sliding_layers else None

    @property
    def num_parameters(self) -> int:
        """Weights of the decoder (embeddings, attention, MLP, norms, head; biases and q/k norms too)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = self.hidden_size * (q + 2 * kv) + q * self.hidden_size
        attention += (q + 2 * kv if self.qkv_bias else 0) + (self.hidden_size if self.o_bias else 0)
        attention += 2 * self.head_dim if self.qk_norm else 0
        layer = attention + (4 if self.gemma else 2) * self.hidden_size
        dense = 3 * self.hidden_size * self.intermediate_size
        sparse = self.num_experts * (3 * self.hidden_size * self.moe_intermediate_size + self.hidden_size)
        mlps = len(self.moe_layers) * sparse + (self.num_layers - len(self.moe_layers)) * dense
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.vocab_size * self.hidden_size + self.num_layers * layer + mlps + self.hidden_size + head

    @property
    def long_rope_length(self) -> int | None:
        """LongRoPE's original length (engine/models/rope.py): a prompt longer than it is rotated long throughout."""
        scaling = self.rope_scaling
        return scaling["original_max_position_embeddings"] if scaling and scaling["rope_type"] == "longrope" else None

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
        act = hf.get("hidden_activation") if family.gemma else hf.get("hidden_act", "silu")
        hidden_act = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}.get(act or "gelu_pytorch_tanh")
        if hidden_act is None or (hidden_act == "gelu_tanh") != family.gemma:
            raise ValueError(f"hidden activation {act!r} is not supported for {arch} "
                             f"({'gelu_pytorch_tanh' if family.gemma else 'silu'} only)")
        num_heads = hf["num_attention_heads"]
        # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters (Gemma 3: one per layer type).
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        local = dict(rope.pop("sliding_attention", None) or {})
        rope = dict(rope.pop("full_attention", None) or rope)
        if float(hf.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("partial_rotary_factor != 1 (RoPE on part of each head) is not supported")
        rope_theta, rope_scaling = _rope(rope, hf.get("rope_theta", family.rope_theta))
        if rope_scaling is not None and rope_scaling["rope_type"] in ("longrope", *family.longrope_names):
            rope_scaling = _longrope({**rope_scaling, "rope_type": "longrope"}, hf)
        sliding_rope = None
        if local or "rope_local_base_freq" in hf:
            sliding_rope = _rope(local, hf.get("rope_local_base_freq", 10000.0))
        attention_bias = bool(hf.get("attention_bias", False))
        sliding_window = hf.get("sliding_window")
        if family.sliding_window_flag is not None and not hf.get(family.sliding_window_flag, False):
            sliding_window = None
        num_layers = hf["num_hidden_layers"]
        sliding_layers = _sliding_layers(hf, family, num_layers) if sliding_window else ()
        if not sliding_layers:
            sliding_window = None
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
            sliding_layers=sliding_layers,
            sliding_rope=sliding_rope if sliding_layers and sliding_rope != (rope_theta, rope_scaling) else None,
            attention_scale=float(hf["query_pre_attn_scalar"]) ** -0.5 if hf.get("query_pre_attn_scalar") else None,
            attention_softcap=hf.get("attn_logit_softcapping") if family.attention_softcap else None,
            final_softcap=hf.get("final_logit_softcapping"),
            gemma=family.gemma,
            hidden_act=hidden_act,
        )


def _rope(params: dict[str, Any], default_theta: float) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) from a config's rope parameters."""
    params = dict(params)
    theta = float(params.pop("rope_theta", default_theta))
    if float(params.pop("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 (RoPE on part of each head) is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    return theta, None if rope_type == "default" else {**params, "rope_type": rope_type}


def _longrope(scaling: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    """LongRoPE's parameters as transformers reads them: the original length (in the rope parameters or beside
    them), and the attention factor (given, else from the length's factor as the paper suggests)."""
    original = scaling.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
    if not original or "short_factor" not in scaling or "long_factor" not in scaling:
        raise ValueError("rope_scaling: longrope needs short_factor, long_factor and original_max_position_embeddings")
    factor = scaling.get("factor") or hf.get("max_position_embeddings", original) / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {**scaling, "original_max_position_embeddings": int(original), "attention_factor": float(attention)}


def _sliding_layers(hf: dict[str, Any], family: Family, num_layers: int) -> tuple[int, ...]:
    """The layers that attend through the window: as ``layer_types`` lists them, else by the family's rule."""
    types = hf.get("layer_types")
    if types:
        if len(types) != num_layers or not set(types) <= {"full_attention", "sliding_attention"}:
            raise ValueError(f"layer_types must name full_attention or sliding_attention for each of the "
                             f"{num_layers} layers, got {types!r}")
        return tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    if family.sliding_layers == "max_window_layers":
        return tuple(range(hf.get("max_window_layers", num_layers), num_layers))
    if family.sliding_layers == "pattern":
        pattern = hf.get("sliding_window_pattern") or family.sliding_pattern
        return tuple(i for i in range(num_layers) if (i + 1) % pattern)
    return tuple(range(num_layers))
