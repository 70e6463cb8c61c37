"""Where and in what precision a model runs: ``device`` and ``dtype`` as the engine arguments say, ``auto`` resolved."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    return choose_dtype(name, checkpoint_dtype, device)[0]


def choose_dtype(name: str, checkpoint_dtype: str | None, device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype to run in, and why (logged at start)."""
    if name != "auto":
        return getattr(torch, name), "asked for"
    if device.type != "cpu":  # on a GPU, the checkpoint's half precision
        half = checkpoint_dtype if checkpoint_dtype in ("float16", "bfloat16") else "bfloat16"
        return getattr(torch, half), f"auto: the checkpoint's {checkpoint_dtype or 'unstated'} dtype on a GPU"
    # On a CPU, bfloat16 where the CPU has bfloat16 units (AVX-512 BF16, AMX) and our kernels run on them
    # (~1.7x float32's throughput), for a checkpoint stored in half precision; float32 elsewhere, where bfloat16
    # would be emulated. Under the CPU kernels bfloat16 layers keep a float32 residual stream
    # (CausalLM.residual_dtype): with transformers' bf16 stream the real model's logits moved by ~0.15 and, asked
    # for France's capital, it answered "L'Étoile, ..." at a near-tie where float32 says Paris (docs/benchmarks.md).
    from inflight.kernels import cpu_kernels

    hardware = cpu_kernels.bf16_hardware()
    if checkpoint_dtype not in ("bfloat16", "float16"):
        return torch.float32, f"auto: the checkpoint's {checkpoint_dtype or 'unstated'} dtype on a CPU"
    if hardware is None:
        return torch.float32, "auto: this CPU has no bfloat16 units"
    if not cpu_kernels.bf16_dot_products():
        return torch.float32, f"auto: this CPU has {hardware}, but the CPU kernels were built without its dot products"
    return torch.bfloat16, f"auto: a {checkpoint_dtype} checkpoint, and this CPU has {hardware}"
