"""The attention backend interface and the registry that picks one.

A backend turns one step's batch layout into its own metadata once per step, then, in every
layer, stores the step's new K/V into the paged cache and attends each query token to its
request's context. The paged cache of a layer is a pair of tensors shaped by
``kv_cache_shape(num_blocks + 1, ...)``; the extra last block is a scratch block that padding
rows write to and nobody reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from inflight.kernels.dense_prefill import sdpa_prompt_attention


@dataclass(frozen=True)
class BatchLayout:
    """One step's batch as flat tensors, built by the model runner.

    Row i feeds ``query_lens[i]`` tokens (flattened in row order) whose KV goes to
    ``slot_mapping`` (block * block_size + offset), and attends to the first ``seq_lens[i]``
    tokens of its block table (context plus itself, causally).
    """

    query_lens: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor  # [num_rows, max_blocks_per_row] int64, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_size: int


class AttentionBackend:
    """Base class: ``prepare`` once per step, then ``store_kv`` and ``forward`` in every layer."""

    name = "base"
    block_size_multiple = 1  # the engine rounds its block_size up to a multiple of this
    block_dim = 0  # which dimension of ``kv_cache_shape`` indexes blocks (for copying blocks in and out)
    # Whether ``forward`` and ``prompt_attention`` take ``window`` (a sliding-window layer attends to its last
    # ``window`` positions, its own included) and ``softcap`` (scores -> cap * tanh(score / cap)): Gemma, Mistral.
    windows_and_softcap = False

    def elementwise_ops(self) -> Any:
        """A module of fused kernels for the per-token work between the matmuls (``rms_norm`` with the
        residual add, ``silu_and_mul``, ``apply_rope``; see ``kernels.triton_fused``), or None: the
        model's PyTorch code, which is also their reference."""
        return None

    def prompt_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, *,
                         window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """One prompt with nothing before it attending to itself, causally (query [tokens, heads, head_dim], key
        and value [tokens, kv_heads, head_dim]): the prefill lane's attention, per prompt. SDPA unless the
        backend has a faster kernel."""
        return sdpa_prompt_attention(query, key, value, scale, window=window, softcap=softcap)

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The layout of one layer's K (or V) cache; each backend picks what its kernels read fastest."""
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def prepare(self, layout: BatchLayout) -> Any:
        """Build whatever per-step metadata ``forward`` needs (shared by all layers)."""
        raise NotImplementedError

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, metadata: Any) -> None:
        """Scatter ``key``/``value`` [num_tokens, num_kv_heads, head_dim] into the cache slots."""
        raise NotImplementedError

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: Any, scale: float, *, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """Attend ``query`` [num_tokens, num_heads, head_dim] to the cache; returns the same shape.

        ``key``/``value`` are this step's new K/V (already stored): a backend may read a fresh prefill's
        context from them instead of the cache.
        """
        raise NotImplementedError


BACKENDS = ("auto", "flash_attn", "triton", "cpu", "torch")


def resolve_backend_name(name: str, device: torch.device, dtype: torch.dtype = torch.float32,
                         windows_or_softcap: bool = False) -> str:
    """``auto``: flash-attn when it is importable on CUDA, then Triton on CUDA (not for a model with sliding windows
    or soft-capped scores: its kernels have neither); on a CPU in float32 or bfloat16 the compiled CPU kernels when
    they build here; else the torch reference."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "triton" and windows_or_softcap:
        raise ValueError("attention_backend 'triton' has no sliding-window or soft-capped attention, which this "
                         "model uses; use 'flash_attn', 'torch' or 'auto'")
    if name != "auto":
        return name
    if device.type != "cuda":
        from inflight.kernels import cpu_kernels

        usable = device.type == "cpu" and dtype in cpu_kernels.DTYPES and cpu_kernels.load() is not None
        return "cpu" if usable else "torch"
    from inflight.kernels.flash_attn_backend import flash_attn_available

    if flash_attn_available():
        return "flash_attn"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "torch"
    return "torch" if windows_or_softcap else "triton"


def get_attention_backend(name: str, device: torch.device, dtype: torch.dtype = torch.float32,
                          windows_or_softcap: bool = False) -> AttentionBackend:
    """The backend ``name`` picks (``resolve_backend_name``); ``windows_or_softcap``: the model has sliding-window
    layers or soft-capped attention scores, which only some backends attend (``windows_and_softcap``)."""
    name = resolve_backend_name(name, device, dtype, windows_or_softcap)
    if name == "flash_attn":
        from inflight.kernels.flash_attn_backend import FlashAttnPagedAttention, flash_attn_available

        if device.type != "cuda" or not flash_attn_available():
            raise ValueError("attention_backend 'flash_attn' needs CUDA and the flash-attn package "
                             "(pip install 'inflight[gpu]')")
        return FlashAttnPagedAttention()
    if name == "triton":
        try:
            import triton  # noqa: F401
        except ImportError:
            raise ValueError("attention_backend 'triton' needs the triton package (pip install triton)") from None
        from inflight.kernels.triton_backend import TritonPagedAttention

        return TritonPagedAttention()
    if name == "cpu":
        from inflight.kernels import cpu_kernels

        if device.type != "cpu" or dtype not in cpu_kernels.DTYPES:
            raise ValueError(f"attention_backend 'cpu' runs float32 or bfloat16 on a CPU, not {dtype} on "
                             f"{device.type}; use 'torch' (or 'auto')")
        if cpu_kernels.load() is None:
            raise ValueError("attention_backend 'cpu' needs a C++ compiler to build its kernels (see the log for "
                             "why the build failed); use 'torch' (or 'auto')")
        from inflight.kernels.cpu_backend import CpuPagedAttention

        return CpuPagedAttention()
    from inflight.kernels.torch_ref import TorchPagedAttention

    return TorchPagedAttention()
