"""FP8 weights on a GPU (``quantization="fp8"``): a linear's weight quantized at load to float8 e4m3, one float32
scale per output row, and a Triton matmul that reads those bytes.

A decode step of a few rows reads every weight once, so an 8-bit weight halves its time against bfloat16. The
kernel loads the weight's bytes and decodes e4m3 to floats with integer operations (sign, 4-bit exponent, 3-bit
mantissa), then multiplies in the activations' dtype: an e4m3 value is exact in bfloat16, float16 and float32, so
the only rounding is the quantization itself, done once at load (round to nearest). The decode needs no FP8
instructions, so it runs on any GPU Triton supports, and under ``TRITON_INTERPRET=1`` on the CPU, which is how
the tests check it against ``reference_linear`` (the same dequantized weight through ``F.linear``).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

FP8_MAX = 448.0  # e4m3's largest finite value


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [n, k] -> (e4m3 bytes [n, k] uint8, scale [n] float32): w ~= float(bytes) * scale, each row scaled
    so its largest magnitude is e4m3's largest value."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale


def dequantize(bits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The weight as float32 [n, k]."""
    return bits.view(torch.float8_e4m3fn).float() * scale[:, None]


def reference_linear(x: torch.Tensor, bits: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """What ``fp8_linear`` computes, in float32 through PyTorch, rounded once to x's dtype."""
    y = F.linear(x.float(), dequantize(bits, scale).to(x.device))
    return (y + bias.float() if bias is not None else y).to(x.dtype)


@triton.jit
def _e4m3_to_float(b):
    """e4m3 bytes (as int32 0..255) -> float32: normals (1 + m/8) * 2^(e-7) as float32 bits, subnormals m * 2^-9,
    and 0x7f / 0xff NaN (e4m3fn has no infinities)."""
    sign = (b >> 7) & 1
    exponent = (b >> 3) & 15
    mantissa = b & 7
    normal = ((sign << 31) | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.int32, bitcast=True)
    normal = normal.to(tl.float32, bitcast=True)
    subnormal = mantissa.to(tl.float32) * 0.001953125  # 2^-9
    subnormal = tl.where(sign == 1, -subnormal, subnormal)
    value = tl.where(exponent == 0, subnormal, normal)
    return tl.where((exponent == 15) & (mantissa == 7), float("nan"), value)


@triton.jit
def _fp8_linear_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                    other=0.0)
        bits = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K),
                       other=0)
        w = _e4m3_to_float(bits.to(tl.int32))
        if DOT_F32:  # (Triton's interpreter: numpy has no bf16 to multiply in)
            acc += tl.dot(x.to(tl.float32), tl.trans(w))
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))  # exact: an e4m3 value fits every float type
    acc = acc * tl.load(scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def fp8_linear(x: torch.Tensor, bits: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [rows, k] times the FP8 weight (``quantize``'s bytes and scales) plus ``bias``: [rows, n] in x's dtype."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    n = bits.shape[0]
    assert bits.dtype is torch.uint8 and bits.shape[1] == k and bits.stride(1) == 1, "bits: [n, k] uint8"
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        # decode-sized batches: many programs along n, one along m; larger: square-ish tiles
        block_m = 16 if rows <= 16 else 64
        block_n, block_k = 64, 64
        grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n))
        _fp8_linear_kernel[grid](x, bits, scale, bias if bias is not None else scale, y, rows, n, k, x.stride(0),
                                 bits.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                                 DOT_F32=x.dtype is torch.float32 or os.environ.get("TRITON_INTERPRET") == "1", BLOCK_M=block_m,
                                 BLOCK_N=block_n, BLOCK_K=block_k)
    return y
