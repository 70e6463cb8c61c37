"""Linears and embeddings whose weight stays quantized, and putting them in a model.

``QuantLinear`` stands where an ``nn.Linear`` was (same ``in_features``/``out_features``/``bias``), computing with
``kernels.quantized.quant_linear`` (the CPU's Q4/Q8) at every row count: one path, so a row's bits never depend on
its batch (as ``cpu_packing``'s bf16 path). ``QuantEmbedding`` dequantizes only the rows a step looks up. A tied
embedding is one packed weight used both ways. ``Fp8Linear`` holds an FP8 weight for ``kernels.triton_fp8``
(``quantization="fp8"``, GPUs): ``to_fp8`` quantizes a loaded model's layer linears.
"""

from __future__ import annotations

import torch
from torch import nn

from inflight.kernels import quantized
from inflight.kernels.quantized import QuantizedWeight


class QuantLinear(nn.Module):
    def __init__(self, weight: QuantizedWeight, bias: nn.Parameter | None = None) -> None:
        """``bias``: the replaced linear's own parameter (the loader may fill it before or after)."""
        super().__init__()
        self.qweight = weight
        self.in_features, self.out_features = weight.in_features, weight.out_features
        # (a buffer: counted with the model's memory; the kernels read qweight's)
        self.register_buffer("packed", weight.packed, persistent=False)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized.quant_linear(x, self.qweight, self.bias)

    def float32_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The sums unrounded, as float32 (the LM head's logits: ``CausalLM.compute_logits``)."""
        if x.dtype is torch.float32:
            return self.forward(x)
        return quantized.quant_linear(x, self.qweight, self.bias, out_dtype=torch.float32)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.qweight.format}"


class QuantEmbedding(nn.Module):
    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.qweight = weight
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features
        self.dtype = dtype
        self.register_buffer("packed", weight.packed, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return quantized.quant_rows(self.qweight, ids, self.dtype).reshape(*ids.shape, self.embedding_dim)


class Fp8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        """``linear``'s weight quantized to e4m3 per output row; its bias (the same parameter) kept."""
        from inflight.kernels import triton_fp8

        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bits, scale = triton_fp8.quantize(linear.weight)
        self.register_buffer("bits", bits, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from inflight.kernels import triton_fp8

        return triton_fp8.fp8_linear(x, self.bits, self.scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format=fp8_e4m3"


@torch.no_grad()
def to_fp8(model: nn.Module) -> int:
    """Every ``nn.Linear`` of the decoder layers as an ``Fp8Linear`` (the LM head and embedding stay: the logits keep
    the model's precision, as vLLM's fp8 does); returns how many."""
    count = 0
    for layer in model.model.layers:
        for name, module in list(layer.named_modules()):
            if isinstance(module, nn.Linear):
                set_submodule(layer, name, Fp8Linear(module))
                count += 1
    return count


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def weight_bytes(model: nn.Module) -> int:
    """The model's memory: its parameters and buffers (packed quantized weights included), each tensor once."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
