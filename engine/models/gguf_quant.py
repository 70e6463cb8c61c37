"""GGUF's quantized tensors as integers and scales, for the weights the engine keeps quantized (``quantization="auto"``).

ggml stores a quantized weight row by row, each row a run of blocks (layouts from ggml's ``ggml-common.h``):

* Q8_0: 32 values, an fp16 scale ``d`` then 32 int8: w = d * q;
* Q4_0: 32 values, ``d`` then 16 bytes of nibbles (value j in byte j's low nibble, value 16 + j in its high one):
  w = d * (q - 8);
* Q4_1: 32 values, ``d`` and ``m`` then the nibbles as Q4_0: w = d * q + m;
* Q4_K: 256 values, fp16 ``d`` and ``dmin``, 12 bytes holding eight 6-bit scales and mins, then 128 bytes of nibbles
  (each 32 bytes: one sub-block of 32 in the low nibbles, the next in the high ones): w = d * sc * q - dmin * m.

``read`` turns one into ``QuantValues``: the integers, and a float32 scale and minimum per block of 32, exactly (Q4_K's
d * sc is an 11-bit mantissa times a 6-bit integer). ``kernels.quantized`` packs them for its kernels (``q4`` for the
4-bit types, ``q8`` for Q8_0). Other types (Q5_*, Q6_K, IQ*, ...) are not kept: the loader dequantizes them.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from inflight.kernels import quantized

# GGUF tensor type -> the kernels' layout
KEPT_TYPES = {"Q4_0": "q4", "Q4_1": "q4", "Q4_K": "q4", "Q8_0": "q8"}


@dataclasses.dataclass(frozen=True, eq=False)
class QuantValues:
    """A quantized weight [n, k] unpacked: w = scale * q + minimum per block of 32 inputs (minimum zero for q8)."""

    format: str  # "q4" or "q8"
    gguf_type: str
    q: torch.Tensor  # [n, k] uint8 (q4) or int8 (q8)
    scale: torch.Tensor  # [n, k / 32] float32
    minimum: torch.Tensor  # [n, k / 32] float32

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def rows(self, order: torch.Tensor) -> QuantValues:
        """The rows reordered (llama.cpp's Q/K permutation undone)."""
        return dataclasses.replace(self, q=self.q[order], scale=self.scale[order], minimum=self.minimum[order])

    def pack(self) -> quantized.QuantizedWeight:
        if self.format == "q4":
            return quantized.pack_q4(self.q, self.scale, self.minimum)
        return quantized.pack_q8(self.q, self.scale)

    def dequantize(self) -> torch.Tensor:
        """float32 [n, k], as the kernels' embedding rows compute it."""
        return quantized.dequantize_values(self.q, self.scale, self.minimum)

    @staticmethod
    def concat(parts: list[QuantValues]) -> QuantValues:
        """Row-wise, as the model fuses q/k/v and gate/up (one format for all parts)."""
        assert len({p.format for p in parts}) == 1
        return QuantValues(parts[0].format, "+".join(dict.fromkeys(p.gguf_type for p in parts)),
                           torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                           torch.cat([p.minimum for p in parts]))


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte ``start`` of every block, as float32."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: the low nibbles first, then the high ones."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _q4k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes -> its eight 6-bit scales and eight 6-bit mins (ggml's get_scale_min_k4)."""
    s = packed.astype(np.uint8)
    low_sc, low_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    high_sc = (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)
    high_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return np.concatenate([low_sc, high_sc], -1), np.concatenate([low_m, high_m], -1)


def read(data: np.ndarray, gguf_type: str, shape: tuple[int, int]) -> QuantValues:
    """``data``: the tensor's bytes as gguf's reader gives them ([n, bytes per row] uint8); ``shape`` [n, k]."""
    n, k = shape
    blocks = np.asarray(data, dtype=np.uint8).reshape(n, -1)
    if gguf_type == "Q8_0":
        b = blocks.reshape(n, k // 32, 34)
        q = b[..., 2:].view(np.int8).reshape(n, k)
        scale, minimum = _f16(b, 0), np.zeros((n, k // 32), np.float32)
    elif gguf_type in ("Q4_0", "Q4_1"):
        size = 18 if gguf_type == "Q4_0" else 20
        b = blocks.reshape(n, k // 32, size)
        q = _nibbles(b[..., size - 16:]).reshape(n, k)
        scale = _f16(b, 0)
        minimum = -8.0 * scale if gguf_type == "Q4_0" else _f16(b, 2)
    elif gguf_type == "Q4_K":
        b = blocks.reshape(n, k // 256, 144)
        d, dmin = _f16(b, 0), _f16(b, 2)
        sc, m = _q4k_scales(b[..., 4:16])  # [n, super, 8]
        qs = b[..., 16:].reshape(n, k // 256, 4, 32)  # four runs of 32 bytes: sub-blocks 2i (low), 2i+1 (high)
        q = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, k)
        scale = (d[..., None] * sc).reshape(n, k // 32).astype(np.float32)
        minimum = (-(dmin[..., None] * m)).reshape(n, k // 32).astype(np.float32)
    else:
        raise ValueError(f"GGUF tensor type {gguf_type} is not kept quantized (kept: {', '.join(KEPT_TYPES)})")
    return QuantValues(KEPT_TYPES[gguf_type], gguf_type, torch.from_numpy(np.ascontiguousarray(q)),
                       torch.from_numpy(np.ascontiguousarray(scale, np.float32)),
                       torch.from_numpy(np.ascontiguousarray(minimum, np.float32)))
