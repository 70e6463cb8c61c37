"""One decoder for the Llama family: Llama (llama3 RoPE), Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm).

The model works on a flat batch: ``[num_tokens]`` ids from many requests at once, with their
positions; attention reads and writes the paged cache through the backend, using the step's
metadata passed down explicitly (no module-global context). q/k/v and gate/up projections are
fused, so a layer is a handful of matmuls; ``engine.models.loader`` splits Hugging Face weights in.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelConfig
from engine.models.rope import RotaryEmbedding, apply_rope
from kernels import AttentionBackend

KVCache = tuple[torch.Tensor, torch.Tensor]
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin of the step's positions


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op
        # Hugging Face's arithmetic for half precision: normalise in float32, cast back, then scale.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim ** -0.5
        self.backend = backend

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, metadata: Any) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(qkv[:, :self.q_size].view(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, self.head_dim))
            qk = torch.cat((q, k), dim=1)
        else:
            qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = apply_rope(qk, *rope)  # q and k heads rotated in one pass
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        k_cache, v_cache = kv_cache
        self.backend.store_kv(k, v, k_cache, v_cache, metadata)
        out = self.backend.forward(q, k, v, k_cache, v_cache, metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache, metadata: Any) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """``forward`` returns hidden states of every token; ``compute_logits`` only for the rows sampled."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.model = DecoderModel(cfg, backend)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                metadata: Any) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        rope = self.rotary.tables(positions)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(x, rope, kv_cache, metadata)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden)).float()  # [num_rows, vocab]
