"""A bfloat16 decode step's decoder layers in one call of the CPU kernels.

A decode step runs ten small kernels a layer from Python (norm, qkv, RoPE, store K/V, attention, o, norm, gate/up,
SiLU-and-mul, down): ~300 calls for the real model's 30 layers, each wrapped in ~10-20 us of Python (checks,
``torch.empty``, ctypes, ``nn.Module.__call__``) around a few microseconds of arithmetic, which added ~5 ms to a
~30 ms step of 13 rows. ``kernels.cpu_kernels.decode_layers`` runs the same kernels in the same order with the same
arguments in C++, so a row gets the same bits either way (tests/engine/test_cpu_decode.py), and the step pays one
call.

``FusedDecode.for_model`` gives one when the whole layer stack is those kernels: a CPU model in bfloat16 under a
float32 residual stream (``CausalLM.residual_dtype``), kernels built with AVX-512 BF16, the CPU attention backend
with its decode kernel for the head size, every linear packed for ``linear_pairs`` (``cpu_packing``) or kept
quantized (``engine.models.quantized``), and no q/k norms (Qwen3's), experts, Gemma layers or sliding windows. ``CausalLM.forward`` takes it for a step whose rows are all one token
(``TorchAttentionMetadata.all_decode``) and keeps the layer-by-layer path for everything else.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from inflight.kernels import cpu_kernels
from inflight.kernels.cpu_backend import CpuPagedAttention
from inflight.kernels.torch_ref import TorchAttentionMetadata
from inflight.engine.models.cpu_packing import EVERY_ROW
from inflight.engine.models.quantized import QuantLinear


def _linear_weight(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, str] | None:
    """(packed weight, bias, format) of a linear ``decode_layers`` can run, else None: a bf16 ``nn.Linear`` packed for
    ``linear_pairs``, or a ``QuantLinear``; a bias in bfloat16."""
    if isinstance(linear, QuantLinear):
        found = (linear.qweight.packed, linear.bias, linear.qweight.format)
    elif getattr(linear, "kernel_rows", 0) == EVERY_ROW and hasattr(linear, "kernel_weight"):
        found = (linear.kernel_weight, linear.bias, "bf16_pairs")
    else:
        return None
    bias = found[1]
    return found if bias is None or bias.dtype is torch.bfloat16 else None


def _pointer(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


class FusedDecode:
    """The decoder layers of a decode-only step through ``cpu_kernels.decode_layers``."""

    def __init__(self, model: nn.Module) -> None:
        cfg = model.config
        self.model = model
        layer = model.model.layers[0]
        self.shape = cpu_kernels.DecodeShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                                             layer.input_layernorm.eps, layer.self_attn.scale)
        self._layers: ctypes.Array | None = None
        self._caches: list | None = None  # the caches self._layers points into

    @classmethod
    def for_model(cls, model: nn.Module, backend) -> FusedDecode | None:
        """One for ``model`` if its layers are exactly the kernels ``decode_layers`` runs, else None."""
        cfg = model.config
        if not (isinstance(backend, CpuPagedAttention) and cpu_kernels.bf16_dot_products()  # (False when not built)
                and cpu_kernels.decode_attention_supports(cfg.head_dim)):
            return None
        if model.model.norm.weight.dtype is not torch.bfloat16 or model.residual_dtype is not torch.float32:
            return None
        if cfg.qk_norm or cfg.num_experts or cfg.num_heads % cfg.num_kv_heads or cfg.gemma or cfg.sliding_layers:
            return None  # (q/k norms, experts, Gemma's layers and sliding windows are not among its kernels)
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if not all(_linear_weight(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
                return None
        return cls(model)

    @staticmethod
    def accepts(metadata) -> bool:
        return isinstance(metadata, TorchAttentionMetadata) and metadata.all_decode

    def _layer_table(self, kv_caches: list) -> ctypes.Array:
        if self._layers is None or self._caches is not kv_caches:
            table = (cpu_kernels.DecodeLayer * len(kv_caches))()
            for entry, layer, (k_cache, v_cache) in zip(table, self.model.model.layers, kv_caches):
                attn, mlp = layer.self_attn, layer.mlp
                for name, tensor in (("input_norm", layer.input_layernorm.weight),
                                     ("post_norm", layer.post_attention_layernorm.weight),
                                     ("k_cache", k_cache), ("v_cache", v_cache)):
                    assert tensor.is_contiguous(), name
                    setattr(entry, name, _pointer(tensor))
                for name, linear in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj),
                                     ("down", mlp.down_proj)):
                    weight, bias, fmt = _linear_weight(linear)
                    assert weight.is_contiguous() and (bias is None or bias.is_contiguous()), name
                    setattr(entry, name, cpu_kernels.LinearWeight(_pointer(weight), _pointer(bias),
                                                                  cpu_kernels.LINEAR_FORMATS[fmt]))
            self._layers, self._caches = table, kv_caches
        return self._layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list,
                metadata: TorchAttentionMetadata) -> torch.Tensor:
        """Hidden states [rows, hidden] before the final norm, as ``CausalLM.forward`` returns them."""
        model = self.model
        x = model.model.embed_tokens(input_ids).contiguous()
        residual = torch.zeros(x.shape, dtype=torch.float32)
        cos, sin = model.rotary.tables(positions)
        k_cache = kv_caches[0][0]
        cpu_kernels.decode_layers(self._layer_table(kv_caches), self.shape, x, residual, cos.contiguous(),
                                  sin.contiguous(), metadata.slot_mapping, metadata.decode_tables,
                                  metadata.decode_seq_lens, k_cache.shape[1], k_cache.shape[2])
        return (x + residual).to(x.dtype)
