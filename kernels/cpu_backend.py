"""The CPU attention backend (float32 or bfloat16): the PyTorch backend with its per-token work in compiled kernels.

A prefill chunk after cached context keeps ``TorchPagedAttention``'s path: its context is gathered once and
shared by all its query tokens, so the copy is cheap next to the matmuls that follow. A chunk with nothing cached
before it (a fresh prompt) attends to itself through ``cpu_kernels.causal_attention``, 2.3-9.8x faster than
torch's fused SDPA at 50-800 tokens on the Sapphire Rapids VM (docs/benchmarks-history.md); heads that are not a
multiple of 32 keep torch's path. A decode row has a single query token, and there the gather is the whole cost:
``kernels.cpu_kernels.paged_decode_attention`` reads each row's K and V in place instead (same cache layout; heads
in multiples of 16, torch's path otherwise). Storing K/V and the model's norms, RoPE and SiLU-and-mul also run as
single-pass kernels (``elementwise_ops``).

The PyTorch decode reads masked slots (weighted by zero), so its ``store_kv`` keeps the cache finite;
nothing here reads a slot past a row's length, so the kernels store K/V as they are. A sliding-window or soft-capped
layer (Gemma's, Mistral's) decodes through the kernel too (it starts at the window's first block); its prompt
chunks take the PyTorch paths (the causal kernel has neither).
"""

from __future__ import annotations

import torch

from inflight.kernels import cpu_kernels
from inflight.kernels.torch_ref import TorchAttentionMetadata, TorchPagedAttention


class CpuPagedAttention(TorchPagedAttention):
    name = "cpu"

    def elementwise_ops(self):
        return cpu_kernels

    def store_kv(self, key, value, k_cache, v_cache, metadata: TorchAttentionMetadata) -> None:
        cpu_kernels.store_kv(key, value, k_cache, v_cache, metadata.slot_mapping)

    def prompt_attention(self, query, key, value, scale: float, *, window: int | None = None,
                         softcap: float | None = None) -> torch.Tensor:
        if window is not None or softcap is not None or not cpu_kernels.causal_attention_supports(query.shape[-1]):
            return super().prompt_attention(query, key, value, scale, window=window, softcap=softcap)
        return cpu_kernels.causal_attention(query, key, value, scale)

    def _decode(self, query, k_cache, v_cache, metadata: TorchAttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        if not cpu_kernels.decode_attention_supports(query.shape[-1]):
            return super()._decode(query, k_cache, v_cache, metadata, scale, window, softcap)  # torch's split-KV
        return cpu_kernels.paged_decode_attention(query, k_cache, v_cache, metadata.decode_tables,
                                                  metadata.decode_seq_lens, scale, window, softcap)
