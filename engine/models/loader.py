"""Load a checkpoint into a ``CausalLM``: a Hugging Face directory, a GGUF file, or the built-in ``demo-tiny``.

A directory's weights are its ``*.safetensors`` (sharded through ``model.safetensors.index.json`` too); a GGUF
file's come dequantized from ``engine.models.gguf_checkpoint``. Either way they arrive under Hugging Face's
names and go through one placing step, which fuses q/k/v and gate/up.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open

from inflight.engine.models.gguf_checkpoint import read_gguf_tensors
from inflight.engine.models.source import ModelSource
from inflight.engine.models.llama import CausalLM
from inflight.kernels import AttentionBackend


# Hugging Face keeps q/k/v and gate/up apart; we fuse them. (our name, its name, shard index)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def build_model(source: ModelSource, backend: AttentionBackend, max_positions: int,
                dtype: torch.dtype, device: torch.device, load_format: str = "auto") -> CausalLM:
    """Create the module without random init (on the meta device), then fill it with the weights.

    ``load_format="dummy"`` fills it with seeded random weights instead of reading files (vLLM's name for
    it): a model of any shape for benchmarks, built in seconds on the device itself."""
    with torch.device("meta"):
        model = CausalLM(source.config, backend, max_positions)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    model.rotary.reset_tables()
    if source.weight_format == "builtin":
        from inflight.engine.models import demo_tiny

        demo_tiny.init_weights(model)
    elif load_format == "dummy":
        init_dummy_weights(model)
    elif source.weight_format == "gguf":
        load_weights(model, read_gguf_tensors(Path(source.name), source.config), Path(source.name).name)
    else:
        load_weights(model, read_safetensors(Path(source.name)), source.name)
    return model.eval()


@torch.no_grad()
def init_dummy_weights(model: CausalLM, seed: int = 0) -> None:
    """Norms 1, everything else N(0, 1/fan_in): activations stay O(1) through many layers, as in a real model."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
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


def load_weights(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]], where: str) -> None:
    """Copy ``tensors`` (Hugging Face names) into the model's parameters, converting to their dtype; every
    parameter must be given once. ``where`` names the checkpoint in errors."""
    params = dict(model.named_parameters())
    missing = set(params)
    cfg = model.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    split_sizes = {"self_attn.qkv_proj": [q, kv, kv], "mlp.gate_up_proj": [cfg.intermediate_size] * 2}
    for hf_name, tensor in tensors:
        if cfg.tie_word_embeddings and hf_name == "lm_head.weight":
            continue
        if "rotary_emb" in hf_name:
            continue
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
        if tensor.shape != target.shape:
            raise ValueError(f"model: weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(target.shape)}")
        target.copy_(tensor)
        missing.discard(name)
    if cfg.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"model: weights missing from checkpoint: {', '.join(sorted(missing)[:8])}")
