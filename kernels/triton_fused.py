"""Fused Triton kernels for the per-token work between the matmuls: RMSNorm (with the residual add),
SiLU-and-multiply, and rotary embedding.

In half precision PyTorch runs each of these as 5-9 small kernels (casts, powers, means, products);
a decode step of a 32-layer model launches about a thousand of them, which cost more GPU time than
reading the weights at small batch. Each one here is a single kernel that reads its inputs once.

They round exactly where Hugging Face's modules round, so outputs match the unfused PyTorch code
(``engine.models.llama``'s reference paths) up to the order of one fp32 sum:
- RMSNorm normalises in fp32, casts to the activation dtype, then multiplies by the weight in it;
- the residual sum is rounded to the activation dtype before it is normalised;
- SiLU's result is rounded before it multiplies ``up``; RoPE is computed in fp32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, stride_x, stride_r, stride_o, hidden, eps,
                     ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One program per token. With ADD_RESIDUAL: residual <- x + residual (rounded, in place), and the
    norm is taken of that sum."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r_ptrs = residual_ptr + row * stride_r + cols
        x = (x.to(tl.float32) + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(r_ptrs, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
    normed = (x32 * inv_rms).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (normed.to(tl.float32) * weight.to(tl.float32)).to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of ``x`` [tokens, hidden]; with ``residual``, of ``x + residual``, which is also written back
    into ``residual`` (it is the next residual stream)."""
    num_tokens, hidden = x.shape
    out = torch.empty_like(x)
    if num_tokens:
        _rms_norm_kernel[(num_tokens,)](
            x, residual if residual is not None else x, weight, out, x.stride(0),
            residual.stride(0) if residual is not None else 0, out.stride(0), hidden, eps,
            ADD_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden))
    return out


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, width, BLOCK: tl.constexpr):
    """out = silu(gate) * up for one token; gate and up are the two halves of the row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + width + cols, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    silu = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)
    tl.store(out_ptr + row * stride_out + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    num_tokens, double = gate_up.shape
    width = double // 2
    out = torch.empty((num_tokens, width), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(width))
    if num_tokens:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(width, block))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                                     width, BLOCK=block)
    return out


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ot, stride_oh, stride_ct,
                 num_heads, half, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    """One program per token: rotate every head of x (rotate-half layout) by the token's angles."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    cols = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (cols < half)
    base = x_ptr + token * stride_xt + heads * stride_xh + cols
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + half, mask=mask, other=0.0)
    cos = tl.load(cos_ptr + token * stride_ct + cols, mask=cols < half, other=0.0)
    sin = tl.load(sin_ptr + token * stride_ct + cols, mask=cols < half, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    out = out_ptr + token * stride_ot + heads * stride_oh + cols
    tl.store(out, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(out + half, (b * cos + a * sin).to(x1.dtype), mask=mask)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] (last dim contiguous); cos/sin fp32 [tokens, 1, head_dim / 2]."""
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    cos, sin = cos.reshape(num_tokens, head_dim // 2), sin.reshape(num_tokens, head_dim // 2)  # -1 fails at 0 tokens
    if num_tokens:
        _rope_kernel[(num_tokens,)](x, cos, sin, out, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
                                    cos.stride(0), num_heads, head_dim // 2,
                                    HEADS_PAD=triton.next_power_of_2(num_heads),
                                    HALF_PAD=triton.next_power_of_2(head_dim // 2))
    return out
