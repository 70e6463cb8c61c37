"""What is known about a model before its weights are read: its config, tokenizer and end-of-sequence ids.

Apart from the loader (``engine.models.loader``, which builds the module and reads weights with torch), so that a
server's processes that only tokenize and route (the router, the replica's front end) never import torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from inflight.engine.models.config import ModelConfig
from inflight.engine.models.gguf_checkpoint import find_gguf_file, read_gguf_source
from inflight.engine.models.packaged import PACKAGED_MODELS, packaged_model_path
from inflight.engine.tokenizer import Tokenizer

DEMO_TINY = "demo-tiny"


@dataclass(frozen=True)
class ModelSource:
    """What is known about a model before its weights are read. ``name``: the built-in model's name or the
    checkpoint's path (a directory, or a GGUF file); ``weight_format`` says which the loader reads."""

    name: str
    config: ModelConfig
    tokenizer: Tokenizer
    eos_token_ids: frozenset[int]
    weight_format: str = "safetensors"  # "safetensors" (a Hugging Face directory), "gguf", or "builtin"


def read_model_source(name_or_path: str) -> ModelSource:
    """``name_or_path``: ``demo-tiny``, a packaged model's name (``PACKAGED_MODELS``), a GGUF file (or a
    directory holding one), or a Hugging Face checkpoint directory (``config.json``, ``*.safetensors``)."""
    if name_or_path == DEMO_TINY:
        from inflight.engine.models import demo_tiny

        return demo_tiny.source()
    path = packaged_model_path(name_or_path) if name_or_path in PACKAGED_MODELS else Path(name_or_path)
    gguf_file = find_gguf_file(path)
    if gguf_file is not None:
        return read_gguf_source(gguf_file)
    if not (path / "config.json").exists():
        raise ValueError(f"model must be {DEMO_TINY!r}, one of {', '.join(PACKAGED_MODELS)}, a .gguf file, or a "
                         f"directory with config.json; got {name_or_path!r}")
    hf_config = json.loads((path / "config.json").read_text())
    config = ModelConfig.from_hf(hf_config)
    tokenizer = Tokenizer.from_dir(path)
    eos = set(_as_list(hf_config.get("eos_token_id")))
    if (path / "generation_config.json").exists():
        eos |= set(_as_list(json.loads((path / "generation_config.json").read_text()).get("eos_token_id")))
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return ModelSource(str(path), config, tokenizer, frozenset(eos))


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
