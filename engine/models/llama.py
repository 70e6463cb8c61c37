"""One decoder for the Llama family: Llama (llama3 RoPE), Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm), Phi-3, their
mixture-of-experts kin, Mixtral and Qwen3-MoE (routed experts in place of the MLP: ``SparseMoE``), and Gemma 2 and 3
(``GemmaRMSNorm``, four norms a layer, GELU-tanh, scaled embeddings, soft-capped scores and logits). A layer's
attention may slide (``ModelConfig.window``): the backend then attends each query to its last ``window`` positions.

The model works on a flat batch: ``[num_tokens]`` ids from many requests at once, with their
positions; attention reads and writes the paged cache through the backend, using the step's
metadata passed down explicitly (no module-global context). q/k/v and gate/up projections are
fused, so a layer is a handful of matmuls; ``engine.models.loader`` splits Hugging Face weights in.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from inflight.engine.models.config import ModelConfig
from inflight.engine.models.rope import RotaryEmbedding, apply_rope
from inflight.kernels import AttentionBackend
from inflight.kernels.dense_prefill import dense_prefill_attention

KVCache = tuple[torch.Tensor, torch.Tensor]
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin of the step's positions


def fused_ops(backend: AttentionBackend):
    """The backend's fused elementwise kernels (``kernels.triton_fused``, ``kernels.cpu_kernels``) when it
    brings them, else None: the PyTorch ops below, which are also their reference."""
    return backend.elementwise_ops()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``, the sum being the next
        residual stream (the fused kernel writes it into ``residual``'s memory)."""
        if self.ops is not None:
            out = self.ops.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op
        # Hugging Face's arithmetic for half precision: normalise in float32, cast back, then scale.
        return self.weight * self._normalized32(x).to(x.dtype)

    def _normalized32(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` in float32 divided by its root mean square (before any weight)."""
        x32 = x.float()
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma's norm: in float32, scaled by ``1 + weight`` (its files store the offset from one), then cast back
    (transformers' arithmetic); with ``residual``, the sum kept in the stream's dtype, as ``RMSNorm``'s."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x, x.dtype)
        total = x + residual
        return self._norm(total, x.dtype), total

    def _norm(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (self._normalized32(x) * (1.0 + self.weight.float())).to(dtype)


def make_norm(cfg: ModelConfig, dim: int, ops=None) -> RMSNorm:
    """The family's norm (``ops``: the backend's fused kernels, which Gemma's arithmetic does not take)."""
    return GemmaRMSNorm(dim, cfg.rms_norm_eps) if cfg.gemma else RMSNorm(dim, cfg.rms_norm_eps, ops)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, index: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = make_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.scale = cfg.attention_scale or cfg.head_dim ** -0.5
        self.window, self.softcap = cfg.window(index), cfg.attention_softcap
        self.local_rope = cfg.sliding_rope is not None and self.window is not None  # rotates by sliding_rope
        self.backend = backend
        ops = fused_ops(backend)
        self.rope = ops.apply_rope if ops is not None else apply_rope

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: KVCache | None, metadata: Any,
                num_tokens: int | None = None) -> torch.Tensor:
        """With ``kv_cache`` None (``metadata`` a ``DensePrefillMetadata``) the batch is whole prompts that touch
        no cache; otherwise the backend stores the new K/V and attends through the paged cache. ``num_tokens``:
        the real tokens when ``x`` carries padding rows after them (``CausalLM.row_padding``); those rows go
        through the projections but never reach the cache or the attention."""
        rows = x.shape[0]
        num_tokens = rows if num_tokens is None else num_tokens
        qkv = self.qkv_proj(x)
        if num_tokens != rows:
            qkv = qkv[:num_tokens]
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(qkv[:, :self.q_size].view(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, self.head_dim))
            qk = torch.cat((q, k), dim=1)
        else:
            qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = self.rope(qk, *rope)  # q and k heads rotated in one pass
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        if kv_cache is None:  # a prefill-only lane batch: whole prompts whose K/V nobody reads again
            out = dense_prefill_attention(q, k, v, metadata, self.scale, self.backend.prompt_attention,
                                          window=self.window, softcap=self.softcap)
        else:
            k_cache, v_cache = kv_cache
            self.backend.store_kv(k, v, k_cache, v_cache, metadata)
            out = self.backend.forward(q, k, v, k_cache, v_cache, metadata, self.scale, window=self.window,
                                       softcap=self.softcap)
        out = out.reshape(num_tokens, self.q_size)
        if num_tokens != rows:
            out = F.pad(out, (0, 0, 0, rows - num_tokens))
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops=None) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gelu = cfg.hidden_act == "gelu_tanh"
        self.ops = None if self.gelu else ops  # (the fused kernel is SiLU's)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.ops is not None:
            return self.down_proj(self.ops.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj((F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up)


class Experts(nn.Module):
    """``num_experts`` SiLU MLPs as two stacked weights (transformers' layout: [experts, 2 x moe_intermediate,
    hidden] for gate and up, [experts, hidden, moe_intermediate] for down). ``kernel(rows, counts)``: every expert
    in one call of the CPU kernels on packed copies of the weights (``engine.models.cpu_packing.pack_expert_weights``
    sets it for bf16 experts), or in two grouped-GEMM launches of Triton (``use_triton``); else a loop over the
    experts in PyTorch (``loop``, also the kernels' reference)."""

    kernel: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """``x`` [tokens, hidden]; each token's ``chosen`` experts [tokens, k] with their ``weights``. The
        (token, expert) pairs are sorted by expert, so each expert's weights are read once for all its tokens;
        a token's contributions are added in expert order, as transformers adds them."""
        k = chosen.shape[1]
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, by token within one
        token = order // k
        rows = x[token]  # [pairs, hidden]
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        if self.kernel is not None:
            out = self.kernel(rows, counts)
        else:
            out = self.loop(rows, counts, self.gate_up_proj, self.down_proj)
        out *= weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token, out)

    def use_triton(self) -> None:
        """The experts through ``kernels.triton_moe`` (a GPU's Triton, or its interpreter on a CPU)."""
        from inflight.kernels import triton_moe

        self.kernel = lambda rows, counts: triton_moe.moe_experts(rows, counts, self.gate_up_proj, self.down_proj)

    @staticmethod
    def loop(rows: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """``rows`` grouped by expert (``counts[e]`` of expert e's) through their experts, one expert at a time."""
        out = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                gate, up = F.linear(rows[start:start + count], gate_up[expert]).chunk(2, dim=-1)
                out[start:start + count] = F.linear(F.silu(gate) * up, down[expert])
                start += count
        return out


class SparseMoE(nn.Module):
    """Mixture of experts (Mixtral, Qwen3-MoE): a router scores the experts (softmax in float32), each token goes to
    its ``num_experts_per_tok`` best, whose outputs are summed by those probabilities (renormalized to sum 1 where
    ``norm_topk_prob``). ``all_reduce``: set by the tensor-parallel cut (each rank holds part of every expert's
    width, so its sums are partial, as a row-parallel linear's)."""

    all_reduce: Callable[[torch.Tensor], None] | None = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = Experts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [tokens, experts]
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.experts(x, weights.to(x.dtype), chosen)
        if self.all_reduce is not None:
            self.all_reduce(out)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, index: int = 0) -> None:
        super().__init__()
        ops = fused_ops(backend)
        self.input_layernorm = make_norm(cfg, cfg.hidden_size, ops)
        self.post_attention_layernorm = make_norm(cfg, cfg.hidden_size, ops)
        if cfg.gemma:  # Gemma also norms each sublayer's output before it joins the stream
            self.pre_feedforward_layernorm = make_norm(cfg, cfg.hidden_size)
            self.post_feedforward_layernorm = make_norm(cfg, cfg.hidden_size)
        self.self_attn = Attention(cfg, backend, index)
        self.mlp = SparseMoE(cfg) if index in cfg.moe_layers else MLP(cfg, ops)
        self.sandwich = cfg.gemma

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ropes: dict[bool, Rope],
                kv_cache: KVCache | None, metadata: Any, num_tokens: int | None = None,
                window_metadata: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): each residual add is fused into the
        norm that follows it; the caller adds the last one. ``ropes``: the step's tables, by ``local_rope``;
        ``window_metadata``: the step's layout in the window caches, which a sliding-window layer's cache is then."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        attn = self.self_attn
        if window_metadata is not None and attn.window is not None:
            metadata = window_metadata
        h = attn(h, ropes[attn.local_rope], kv_cache, metadata, num_tokens)
        if not self.sandwich:
            h, residual = self.post_attention_layernorm(h, residual)
            return self.mlp(h), residual
        h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        # its weight given, not drawn: under build_model's meta device a normal_ init would import torch._dynamo
        # (~3 s of every engine's start) for values the checkpoint overwrites anyway
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, index) for index in range(cfg.num_layers))
        self.norm = make_norm(cfg, cfg.hidden_size, fused_ops(backend))


class CausalLM(nn.Module):
    """``forward`` returns hidden states of every token; ``compute_logits`` only for the rows sampled.

    ``row_padding``: None, or the row count a forward of n tokens runs with (n's bucket, see
    ``engine.models.cpu_packing``): the tokens are padded once at the embedding, instead of at every linear,
    and the padding rows are dropped from the result."""

    row_padding: Callable[[int], int] | None = None
    # None: the residual stream in the activations' dtype (transformers' choice). float32 under bfloat16 layers (the
    # CPU kernels' norm adds into it, ``engine.model_runner``): its sums are not rounded to bf16 at every layer, the
    # rounding that moved the real model's logits by ~0.15 and turned a near-tie (docs/benchmarks.md, issue 47).
    residual_dtype: torch.dtype | None = None
    # A decode-only step's layers in one call of the CPU kernels (engine.models.cpu_decode), where the runner set one.
    fused_decode: Any = None

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.local_rotary = RotaryEmbedding(cfg.head_dim, max_positions, *cfg.sliding_rope) \
            if cfg.sliding_rope is not None else None
        self.model = DecoderModel(cfg, backend)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            head = getattr(self.lm_head, "linear", self.lm_head)  # (a tensor-parallel head wraps its linear)
            head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache] | None,
                metadata: Any, window_metadata: Any = None) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] before the final norm. ``kv_caches`` None: a prefill-only lane
        batch (``metadata`` is a ``DensePrefillMetadata``), attended without any cache. ``window_metadata``: the
        step in the window caches' tables, where the runner keeps the sliding-window layers' KV apart."""
        if self.fused_decode is not None and kv_caches is not None and self.fused_decode.accepts(metadata):
            return self.fused_decode.forward(input_ids, positions, kv_caches, metadata)
        num_tokens = input_ids.shape[0]
        rows = self.row_padding(num_tokens) if self.row_padding is not None else num_tokens
        if rows != num_tokens:  # padding rows (token 0), dropped below; attention and RoPE see only real tokens
            input_ids = F.pad(input_ids, (0, rows - num_tokens))
        x = self.model.embed_tokens(input_ids)  # [rows, hidden]
        if self.config.gemma:  # (the scale rounded to the weights' dtype first, as transformers does)
            x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        rope = self.rotary.tables(positions)
        ropes = {False: rope, True: self.local_rotary.tables(positions) if self.local_rotary is not None else rope}
        residual = None
        if self.residual_dtype is not None and self.residual_dtype != x.dtype:
            # The first norm adds the embedding into it: zero plus a bf16 value is that value, exactly.
            residual = torch.zeros(x.shape, dtype=self.residual_dtype, device=x.device)
        caches = kv_caches if kv_caches is not None else [None] * len(self.model.layers)
        for layer, kv_cache in zip(self.model.layers, caches):
            x, residual = layer(x, residual, ropes, kv_cache, metadata, num_tokens, window_metadata)
        hidden = (x + residual).to(x.dtype)  # (one rounding, where the stream is float32)
        return hidden[:num_tokens] if rows != num_tokens else hidden

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm: what transformers calls ``last_hidden_state`` (embeddings pool it)."""
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_rows, vocab] float32. A half-precision LM head that can give its sums unrounded does
        (``engine.models.cpu_packing``): bf16 logits are an eighth apart near 25, so candidates a few hundredths
        apart tie, and which wins then depends on the path that computed them."""
        normed = self.model.norm(hidden)
        exact = getattr(self.lm_head, "float32_forward", None)
        logits = exact(normed) if exact is not None else self.lm_head(normed).float()
        cap = self.config.final_softcap
        if cap is not None and logits is not None:  # (None: a vocabulary-parallel head's rank other than 0)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[num_rows] int64: each row's most likely token (the first on a tie). A vocabulary-parallel head
        (``tensor_parallel``) compares the ranks' best and returns None on ranks other than 0."""
        parallel = getattr(self.lm_head, "greedy_tokens", None)
        if parallel is not None:  # (soft-capping keeps the order: each rank's best stays its best)
            return parallel(self.model.norm(hidden))
        return self.compute_logits(hidden).argmax(dim=-1)
