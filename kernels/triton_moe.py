"""A mixture-of-experts layer's experts on a GPU: one grouped-GEMM launch for every expert's gate/up, SiLU-and-mul,
one launch for every expert's down.

The model hands over the step's (token, expert) rows already grouped by expert, ``counts[e]`` of expert e's
(``Experts.forward``), so each expert's weights are read once for all its rows. The host cuts each expert's rows
into tiles of ``BLOCK_M`` (``tiles``): a program multiplies one tile by one block of its expert's weight, and no tile
mixes experts, so no row is padded to another expert's and an expert no row chose costs nothing. Accumulation in
float32, rounded once to the activations' dtype. Tested against ``Experts.loop`` under ``TRITON_INTERPRET=1`` on the
CPU, as the attention kernels are.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64


@triton.jit
def _grouped_linear_kernel(x_ptr, w_ptr, y_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, N, K, stride_xm,
                           stride_we, stride_wn, stride_ym, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tile, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    start, end = tl.load(tile_start_ptr + tile), tl.load(tile_end_ptr + tile)
    rows = start + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=(rows[:, None] < end) & (ks[None, :] < K),
                    other=0.0)
        w = tl.load(w_base + cols[:, None] * stride_wn + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K),
                    other=0.0)
        if DOT_F32:  # float32 weights, or Triton's interpreter (numpy has no bf16 to multiply in)
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            acc += tl.dot(x, tl.trans(w))
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < end) & (cols[None, :] < N))


def tiles(counts: list[int], block_m: int = BLOCK_M) -> tuple[list[int], list[int], list[int]]:
    """(expert, first row, end row) of each tile: each expert's rows (``counts``, in expert order) cut every
    ``block_m``."""
    experts, starts, ends = [], [], []
    row = 0
    for expert, count in enumerate(counts):
        for start in range(row, row + count, block_m):
            experts.append(expert)
            starts.append(start)
            ends.append(min(start + block_m, row + count))
        row += count
    return experts, starts, ends


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``x`` [rows, k] grouped by expert (``counts``) times each row's expert's ``weight`` [experts, n, k] (transposed,
    as ``F.linear``): [rows, n] in x's dtype."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    n = weight.shape[1]
    assert weight.shape[2] == k and weight.stride(2) == 1 and len(counts) == weight.shape[0] and sum(counts) == rows
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    experts, starts, ends = tiles(counts)
    if experts:
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int32, device=x.device)  # noqa: E731
        grid = (len(experts), triton.cdiv(n, BLOCK_N))
        _grouped_linear_kernel[grid](
            x, weight, y, as_tensor(experts), as_tensor(starts), as_tensor(ends), n, k, x.stride(0), weight.stride(0),
            weight.stride(1), y.stride(0),
            DOT_F32=x.dtype is torch.float32 or os.environ.get("TRITON_INTERPRET") == "1",
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y


def moe_experts(rows: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``rows`` grouped by expert through their experts (``Experts.loop``'s contract): gate/up [experts, 2 x width,
    hidden], down [experts, hidden, width]."""
    gate, up = grouped_linear(rows, gate_up, counts).chunk(2, dim=-1)
    return grouped_linear(F.silu(gate) * up, down, counts)
