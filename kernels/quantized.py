"""Weights kept quantized on the CPU: packing them for ``csrc/quant_linear.h`` and calling its kernels.

Two layouts cover GGUF's common types (``engine.models.gguf_quant`` reads them out of a file):

* ``q4``: w = scale * q + min, q in 0..15, a float32 scale and min per block of 32 inputs (Q4_0, Q4_1, Q4_K; 6 bits
  a weight);
* ``q8``: w = scale * q, q in -128..127, a float32 scale per block (Q8_0; 10 bits a weight).

``quant_linear`` quantizes the activations per row and block of 32 to int8 (a float scale each) and sums the
products in integers on AVX-512 VNNI, in float32 across blocks; ``reference_linear`` is the same arithmetic in
PyTorch (the tests' reference), ``dequantize`` the weight as floats. A row's result does not depend on the rows
beside it. The kernels are part of ``kernels.cpu_kernels``' build (one library).
"""

from __future__ import annotations

import dataclasses

import torch

from inflight.kernels import cpu_kernels

BLOCK = 32  # inputs per quantization block (the kernels' QBLOCK)
GROUP = 16  # output rows per packed group (QROWS)
FORMATS = ("q4", "q8")
_BLOCK_BYTES = {"q4": 256 + 128, "q8": 512 + 128}


@dataclasses.dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A weight [out_features, in_features] packed for the kernels: ``packed`` uint8 [groups, blocks, bytes]."""

    format: str
    packed: torch.Tensor
    out_features: int
    in_features: int


def _check_blocks(k: int) -> None:
    if k % BLOCK:
        raise ValueError(f"in_features: {k} is not a multiple of the quantization block ({BLOCK})")


def _grouped(t: torch.Tensor, n: int) -> torch.Tensor:
    """[n, ...] padded with zero rows to whole groups, as [groups, 16, ...]."""
    pad = -n % GROUP
    if pad:
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
    return t.reshape(-1, GROUP, *t.shape[1:])


def _per_block(values: torch.Tensor, n: int) -> torch.Tensor:
    """[n, blocks] of 4-byte values as the packed [groups, blocks, 64] bytes (16 rows' values per block)."""
    return _grouped(values, n).transpose(1, 2).contiguous().view(torch.uint8)


def pack_q4(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> QuantizedWeight:
    """q [n, k] integers 0..15; scale, minimum [n, k / 32] float32: w = scale * q + minimum."""
    n, k = q.shape
    _check_blocks(k)
    if scale.shape != (n, k // BLOCK) or minimum.shape != scale.shape:
        raise ValueError("scale and minimum: one per row and block of 32")
    values = _grouped(q.to(torch.uint8), n).reshape(-1, GROUP, k // BLOCK, 2, 4, 4)  # [g, r, b, half, c, j]
    nibbles = values.permute(0, 2, 3, 4, 1, 5)  # [g, b, half, c, r, j]
    packed_values = (nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)).reshape(-1, k // BLOCK, 256)
    packed = torch.cat([packed_values, _per_block(scale.float(), n), _per_block(minimum.float(), n)], dim=2)
    return QuantizedWeight("q4", packed.contiguous(), n, k)


def pack_q8(q: torch.Tensor, scale: torch.Tensor) -> QuantizedWeight:
    """q [n, k] integers -128..127; scale [n, k / 32] float32: w = scale * q."""
    n, k = q.shape
    _check_blocks(k)
    if scale.shape != (n, k // BLOCK):
        raise ValueError("scale: one per row and block of 32")
    q8 = q.to(torch.int8)
    values = _grouped(q8, n).reshape(-1, GROUP, k // BLOCK, 8, 4).permute(0, 2, 3, 1, 4)  # [g, b, c, r, j]
    sums = q8.reshape(n, k // BLOCK, BLOCK).sum(-1, dtype=torch.int32) * 128
    packed = torch.cat([values.reshape(-1, k // BLOCK, 512).view(torch.uint8), _per_block(scale.float(), n),
                        _per_block(sums, n)], dim=2)
    return QuantizedWeight("q8", packed.contiguous(), n, k)


def unpack(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [n, k] int32, scale [n, k / 32], minimum [n, k / 32] (zeros for q8)): what ``pack_*`` was given."""
    n, k, nb = weight.out_features, weight.in_features, weight.in_features // BLOCK
    p = weight.packed
    values = 256 if weight.format == "q4" else 512

    def per_row(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return data.contiguous().view(dtype).transpose(1, 2).reshape(-1, nb)[:n]

    scale = per_row(p[:, :, values:values + 64], torch.float32)
    if weight.format == "q4":
        nibbles = p[:, :, :256].reshape(-1, nb, 4, GROUP, 4)  # [g, b, c, r, j]
        halves = torch.stack([nibbles & 15, nibbles >> 4], dim=2)  # [g, b, half, c, r, j]
        q = halves.permute(0, 4, 1, 2, 3, 5).reshape(-1, k)[:n].int()
        minimum = per_row(p[:, :, 320:384], torch.float32)
    else:
        q = p[:, :, :512].contiguous().view(torch.int8).reshape(-1, nb, 8, GROUP, 4).permute(0, 3, 1, 2, 4)
        q = q.reshape(-1, k)[:n].int()
        minimum = torch.zeros_like(scale)
    return q, scale, minimum


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight as floats [n, k]: what the kernels' ``quant_rows`` gives (float32, then rounded to ``dtype``)."""
    return dequantize_values(*unpack(weight), dtype)


def dequantize_values(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """scale * q + minimum per block of 32, from what ``pack_*`` takes (q [n, k], scale and minimum [n, k / 32])."""
    n, k = q.shape
    blocks = q.double().reshape(n, -1, BLOCK)
    # fma(scale, q, min) as the kernel: the product is exact in float64, and so is the sum at these magnitudes
    w = blocks * scale.double()[..., None] + minimum.double()[..., None]
    return w.reshape(n, k).float().to(dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, k] per block of 32 as the kernels do: (xq [rows, k] int, d [rows, k / 32] float32)."""
    blocks = x.float().reshape(x.shape[0], -1, BLOCK)
    d = blocks.abs().amax(-1) / 127.0
    inverse = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(blocks * inverse[..., None]).reshape(x.shape).int(), d


def reference_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What ``quant_linear`` computes, in float64 from the same integers: the activations quantized per block, each
    block's exact integer dot product scaled. [rows, n] float32; equal to the kernel's up to float32 summation."""
    q, scale, minimum = unpack(weight)
    xq, d = quantize_activations(x)
    nb = weight.in_features // BLOCK
    xb = xq.double().reshape(x.shape[0], nb, BLOCK)
    qb = q.double().reshape(weight.out_features, nb, BLOCK)
    dots = torch.einsum("mbi,nbi->mnb", xb, qb)  # exact integers
    out = (dots * scale.double()[None] * d.double()[:, None, :]).sum(-1)
    if weight.format == "q4":
        out += (xb.sum(-1) * d.double()) @ minimum.double().T
    if bias is not None:
        out += bias.double()
    return out.float()


def _kernel(name: str):
    lib = cpu_kernels.load()
    assert lib is not None, "the CPU kernels are not built here (check kernels.cpu_kernels.load() first)"
    return getattr(lib, name)


def available() -> bool:
    """Whether the kernels are built here (on machines without VNNI they run scalar code: same bits, far slower)."""
    return cpu_kernels.load() is not None


def quant_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [rows, k] (float32 or bfloat16) times the quantized weight, plus ``bias`` (x's dtype): [rows, n] in
    ``out_dtype`` (x's dtype, or float32 under bfloat16 x: the logits). ``out``: write into it instead (its rows may be
    wider: a column slice of a fused output)."""
    suffix = cpu_kernels.SUFFIXES.get(x.dtype)
    assert suffix is not None and x.is_cpu, "quant_linear takes float32 or bfloat16 CPU activations"
    out_dtype = out_dtype or x.dtype
    if out_dtype is not x.dtype:
        assert x.dtype is torch.bfloat16 and out_dtype is torch.float32, "out_dtype: x's, or float32 under bfloat16"
        suffix = "bf16_f32"
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    assert k == weight.in_features, "x's width must be the weight's in_features"
    if bias is not None:
        assert bias.dtype is x.dtype and bias.is_contiguous() and bias.shape == (weight.out_features,)
    if out is None:
        out = torch.empty((rows, weight.out_features), dtype=out_dtype)
    assert out.dtype is out_dtype and out.stride(1) == 1 and out.shape == (rows, weight.out_features)
    _kernel(f"quant_linear_{weight.format}_{suffix}")(
        x.data_ptr(), weight.packed.data_ptr(), bias.data_ptr() if bias is not None else None, out.data_ptr(), rows,
        weight.out_features, k, x.stride(0), out.stride(0), torch.get_num_threads())
    return out


def quant_rows(weight: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of the weight dequantized (an embedding lookup): [len(ids), k] ``dtype``."""
    suffix = cpu_kernels.SUFFIXES.get(dtype)
    assert suffix is not None, "quant_rows gives float32 or bfloat16"
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= weight.out_features):
        raise ValueError(f"ids: out of range for {weight.out_features} rows")
    out = torch.empty((ids.numel(), weight.in_features), dtype=dtype)
    _kernel(f"quant_rows_{weight.format}_{suffix}")(
        weight.packed.data_ptr(), ids.data_ptr(), ids.numel(), weight.in_features, out.data_ptr(),
        torch.get_num_threads())
    return out

