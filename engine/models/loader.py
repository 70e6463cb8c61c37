"""Load a checkpoint into a ``CausalLM``: a Hugging Face directory, a GGUF file, or the built-in ``demo-tiny``.

A directory's weights are its ``*.safetensors`` (sharded through ``model.safetensors.index.json`` too); a GGUF
file's come from ``engine.models.gguf_checkpoint``, dequantized, or under ``quantization="auto"`` on the CPU its
Q4/Q8 weights as they are. Either way they arrive under Hugging Face's names and go through one placing step, which
fuses q/k/v and gate/up; a quantized linear (all its fused parts in one kept layout) or embedding replaces the
module with ``engine.models.quantized``'s, and one whose parts differ is dequantized.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open

from inflight.engine.config import QUANTIZATIONS
from inflight.engine.models.gguf_checkpoint import read_gguf_tensors
from inflight.engine.models.gguf_quant import QuantValues
from inflight.engine.models.llama import CausalLM
from inflight.engine.models.quantized import QuantEmbedding, QuantLinear, set_submodule, to_fp8
from inflight.engine.models.source import ModelSource
from inflight.engine.models.tensor_parallel import Shard, cut_tensors, shard_model
from inflight.engine.parallel.collectives import Collectives
from inflight.kernels import AttentionBackend, quantized

logger = logging.getLogger(__name__)

# One expert's matrices (legacy per-expert names; Mixtral's w1/w3/w2 are gate/up/down): into the stacked weights.
_EXPERT = re.compile(r"^(.*)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_PARTS = {"gate_proj": ("gate_up_proj", 0), "w1": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                 "w3": ("gate_up_proj", 1), "down_proj": ("down_proj", None), "w2": ("down_proj", None)}
# Hugging Face keeps q/k/v and gate/up apart; we fuse them. (our name, its name, shard index)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def keeps_quantized(quantization: str, device: torch.device) -> bool:
    """Whether a GGUF file's Q4/Q8 weights stay quantized: ``quantization`` "auto", on the CPU, kernels built."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: must be one of {QUANTIZATIONS}, got {quantization!r}")
    if quantization in ("none", "fp8"):
        return False
    if device.type != "cpu":
        logger.info("quantized weights are dequantized on %s (their kernels are the CPU's)", device.type)
        return False
    if not quantized.available():
        logger.warning("the CPU kernels are not built: quantized weights are dequantized (more memory, slower decode)")
        return False
    return True


def build_model(source: ModelSource, backend: AttentionBackend, max_positions: int,
                dtype: torch.dtype, device: torch.device, load_format: str = "auto",
                quantization: str = "auto", shard: Shard | None = None, comm: Collectives | None = None) -> CausalLM:
    """Create the module without random init (on the meta device), then fill it with the weights.

    ``load_format="dummy"`` fills it with seeded random weights instead of reading files (vLLM's name for
    it): a model of any shape for benchmarks, built in seconds on the device itself. ``quantization``: see
    ``QUANTIZATIONS``. ``shard`` (tensor parallelism, its collectives ``comm``): this rank's part, cut from the
    module before it is allocated and from each checkpoint tensor as it is read, so no rank holds the whole model;
    generated weights (demo-tiny's, dummy) are made whole, as one rank makes them, then cut."""
    keep = source.weight_format == "gguf" and keeps_quantized(quantization, device)
    reads_files = source.weight_format != "builtin" and load_format != "dummy"
    with torch.device("meta"):
        model = CausalLM(source.config, backend, max_positions)
    if shard is not None and reads_files:
        shard_model(model, shard, comm)  # (shapes only, on the meta device)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()  # (to_empty gave each its own memory)
    for rotary in (model.rotary, model.local_rotary):
        if rotary is not None:
            rotary.reset_tables()
    if source.weight_format == "builtin":
        from inflight.engine.models import demo_tiny

        demo_tiny.init_weights(model)
    elif load_format == "dummy":
        init_dummy_weights(model)
    else:
        where = Path(source.name).name if source.weight_format == "gguf" else source.name
        tensors = (read_gguf_tensors(Path(source.name), source.config, keep) if source.weight_format == "gguf"
                   else read_safetensors(Path(source.name)))
        load_weights(model, cut_tensors(tensors, source.config, shard) if shard is not None else tensors, where)
    if shard is not None and not reads_files:
        shard_model(model, shard, comm)
    if quantization == "fp8":
        check_fp8(device)
        logger.info("fp8: %d linears' weights quantized to float8 e4m3", to_fp8(model))
    return model.eval()


def check_fp8(device: torch.device) -> None:
    """``quantization="fp8"`` runs a Triton kernel: on a CUDA device, or under Triton's interpreter (the tests)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"quantization: 'fp8' needs a CUDA GPU (its kernel is Triton's), not {device.type}; "
                         "on a CPU, 'auto' keeps a GGUF file's Q4/Q8 weights quantized")
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise ValueError("quantization: 'fp8' needs Triton, which is not installed") from e


@torch.no_grad()
def init_dummy_weights(model: CausalLM, seed: int = 0) -> None:
    """Norms 1, everything else N(0, 1/fan_in): activations stay O(1) through many layers, as in a real model."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(0.0 if model.config.gemma else 1.0)  # (Gemma's norms scale by 1 + weight)
        elif name.endswith("embed_tokens.weight"):
            param.normal_(0.0, 1.0, generator=generator)
        else:
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / shard for shard in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {path}")
    return files


def read_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in _weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_weights(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor | QuantValues]], where: str) -> None:
    """Copy ``tensors`` (Hugging Face names) into the model's parameters, converting to their dtype; every
    parameter must be given once. A ``QuantValues`` weight is placed by ``_place_quantized`` once all the parts of
    its module have come. ``where`` names the checkpoint in errors."""
    params = dict(model.named_parameters())
    missing = set(params)
    cfg = model.config
    attention = model.model.layers[0].self_attn  # (its sizes and the MLP's: a tensor-parallel rank's)
    dense = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate_up_proj")]  # (not the experts)
    split_sizes = {"self_attn.qkv_proj": [attention.q_size, attention.kv_size, attention.kv_size],
                   "mlp.gate_up_proj": [dense[0].intermediate_size] * 2 if dense else []}
    pending: dict[str, tuple[str, dict[int, QuantValues]]] = {}  # our weight name -> (fused, its parts so far)
    for hf_name, tensor in tensors:
        if cfg.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        if "rotary_emb" in hf_name:
            continue
        hf_name = hf_name.replace(".block_sparse_moe.", ".mlp.")  # (Mixtral's name for its experts' block)
        name, fused, shard, target = _target(params, hf_name, split_sizes, where)
        if tensor.shape != target.shape:
            raise ValueError(f"model: weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(target.shape)}")
        if isinstance(tensor, QuantValues) and ".experts." in name:  # (stacked experts have no quantized layout)
            tensor = tensor.dequantize()
        if isinstance(tensor, QuantValues):
            parts = pending.setdefault(name, (fused, {}))[1]
            parts[shard] = tensor
            if len(parts) == (len(split_sizes[fused]) if fused is not None else 1):
                _place_quantized(model, name, [parts[i] for i in range(len(parts))], params[name])
                del pending[name]
        else:
            target.copy_(tensor)
        missing.discard(name)
    for name, (fused, parts) in pending.items():  # a fused linear whose other parts came as floats: dequantized
        logger.info("%s: dequantized (its fused parts are not all quantized)", name.removesuffix(".weight"))
        for shard, values in parts.items():
            start = sum(split_sizes[fused][:shard])
            params[name].data[start:start + values.shape[0]].copy_(values.dequantize())
    if cfg.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"model: weights missing from checkpoint: {', '.join(sorted(missing)[:8])}")


def _target(params: dict[str, torch.Tensor], hf_name: str, split_sizes: dict[str, list[int]],
            where: str) -> tuple[str, str | None, int, torch.Tensor]:
    """Where a checkpoint tensor goes: (our parameter's name, the fused linear it is part of or None, its part's
    index, the part of the parameter it fills). One expert's matrix fills its slot of the stacked weights (its half of
    gate/up); q/k/v and gate/up their rows of the fused linear."""
    expert = _EXPERT.match(hf_name)
    if expert is not None:
        prefix, index, part = expert.groups()
        stacked, half = _EXPERT_PARTS[part]
        name = f"{prefix}.mlp.experts.{stacked}"
        if name not in params or int(index) >= params[name].shape[0]:
            raise ValueError(f"model: unexpected weight {hf_name!r} in {where}")
        target = params[name].data[int(index)]
        if half is not None:
            rows = target.shape[0] // 2
            target = target[half * rows:(half + 1) * rows]
        return name, None, 0, target
    name, fused, shard = hf_name, None, 0
    for hf_part, (our_part, index) in _FUSED.items():
        if f".{hf_part}." in hf_name:
            name, fused, shard = hf_name.replace(hf_part, our_part), our_part, index
            break
    if name not in params:
        raise ValueError(f"model: unexpected weight {hf_name!r} in {where}")
    target = params[name].data
    if fused is not None:
        sizes = split_sizes[fused]
        start = sum(sizes[:shard])
        target = target[start:start + sizes[shard]]
    return name, fused, shard, target


def _place_quantized(model: CausalLM, name: str, parts: list[QuantValues], param: torch.Tensor) -> None:
    """A weight's quantized parts (q/k/v or gate/up, or one) into the model: the module replaced by a quantized one
    when the parts share a layout, else dequantized into ``param``."""
    module_name = name.removesuffix(".weight")
    if len({p.format for p in parts}) > 1:
        logger.info("%s: parts of %s types dequantized (one fused linear keeps one layout)", module_name,
                    "/".join(p.gguf_type for p in parts))
        param.data.copy_(torch.cat([p.dequantize() for p in parts]))
        return
    weight = QuantValues.concat(parts).pack()
    dtype = param.dtype
    if module_name == "model.embed_tokens":
        set_submodule(model, module_name, QuantEmbedding(weight, dtype))
        if model.config.tie_word_embeddings:  # the one weight both ways
            model.lm_head = QuantLinear(weight)
    else:
        old = model.get_submodule(module_name)
        set_submodule(model, module_name, QuantLinear(weight, old.bias))
