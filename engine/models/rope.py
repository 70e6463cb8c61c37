"""Rotary position embeddings (rotate-half layout, as Hugging Face Llama), with llama3, linear and longrope scaling.

LongRoPE (Phi-3's 128k models): inverse frequencies divided by a short factor per dimension while a sequence is within
``original_max_position_embeddings``, by a long one once it is longer, and cos/sin scaled by an attention factor.
As transformers does, a sequence longer than that is rotated long throughout: a prompt from the start, and a shorter
one that grows past it is computed again, long (``Scheduler._pick``). So the tables hold two runs of rows, short
``[0, max_positions)`` and long ``[max_positions, 2 x max_positions)``; a long sequence's tokens look up the second
(``RotaryEmbedding.long_offset``, added to their positions by the model runner).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None, long: bool = False) -> torch.Tensor:
    """``long``: longrope's long factors (else its short ones)."""
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** shape)
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "longrope":  # (transformers' expression, for its bits)
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * theta ** shape)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported (default, linear, llama3, longrope)")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are stretched by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables; ``forward`` rotates q and k in place of a per-step computation."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        longrope = scaling is not None and scaling["rope_type"] == "longrope"
        # longrope: where a long prompt's rows start (module docstring); None: one run of rows
        self.long_offset = max_positions if longrope else None
        rows = 2 * max_positions if longrope else max_positions
        self.register_buffer("cos", torch.empty(rows, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(rows, head_dim // 2), persistent=False)
        self.reset_tables()

    def reset_tables(self) -> None:
        """(Re)compute the tables, in float32, on the buffers' device (after ``to_empty`` too)."""
        if self.cos.is_meta:
            return
        device = self.cos.device
        positions = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, head_dim / 2]
        scale = 1.0
        if self.long_offset is not None:
            long_freqs = positions[:, None] * rope_inv_freq(self.head_dim, self.theta, self.scaling, long=True).to(device)
            freqs = torch.cat((freqs, long_freqs))
            scale = self.scaling["attention_factor"]
        self.cos = freqs.cos() * scale
        self.sin = freqs.sin() * scale

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the step's positions, [num_tokens, 1, head_dim / 2]: looked up once, used by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [num_tokens, num_heads, head_dim] by its positions' angles (rotate-half layout)."""
    if x.dtype != torch.float32:
        return apply_rope(x.float(), cos, sin).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
