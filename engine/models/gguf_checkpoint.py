"""GGUF checkpoints (llama.cpp's single-file format): the model's shape, tokenizer and weights from one file.

Read with the ``gguf`` package (ggml's own reader, numpy only). What a server's front processes need (the
config, the tokenizer, the chat template, the end-of-sequence ids) is converted once per file into a small
cache (``$INFLIGHT_CACHE``/gguf, default ``~/.cache/inflight/gguf``): parsing the file's 50k-token vocabulary
takes seconds, and the router, each replica and each engine process would otherwise pay it at every start.
The weights are read at every load and dequantized to the engine's dtype, or, under ``quantization="auto"`` on the
CPU, the Q4_0/Q4_1/Q4_K/Q8_0 ones kept as they are (``gguf_quant``); Q and K of Llama-architecture files
are un-permuted back from ggml's RoPE layout to the Hugging Face one the model uses.

Supported: architectures ``ARCHITECTURES``, byte-level BPE vocabularies (``tokenizer.ggml.model`` "gpt2")
with the pre-tokenizers in ``PRE_TOKENIZERS``, and every tensor type in ``SUPPORTED_TYPES``. Anything else
is a ``ValueError`` that names it and lists what is supported.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from inflight.engine.models.config import ModelConfig
from inflight.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    import gguf
    import torch

    from inflight.engine.models.gguf_quant import QuantValues

logger = logging.getLogger(__name__)

CACHE_VERSION = 1  # bump when what the cache holds changes

# general.architecture -> the Hugging Face architecture our decoder implements it as. Mistral's files say "llama".
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# llama.cpp's converter permutes these architectures' Q and K rows for its RoPE; NeoX-style RoPE ones it leaves.
PERMUTED_QK = {"llama"}

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(*patterns: str) -> pre_tokenizers.PreTokenizer:
    """llama.cpp's pre-tokenizers: the text split by each regex in turn, the pieces then written in bytes."""
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# tokenizer.ggml.pre -> (how text is split before BPE, as llama.cpp's llama-vocab.cpp does; ignore_merges: a
# whole word in the vocabulary is one token, as Llama 3's tokenizer.json says).
PRE_TOKENIZERS: dict[str, tuple[Any, bool]] = {
    "default": (lambda: _split_then_bytes(_GPT2_SPLIT), False),
    "gpt-2": (lambda: _split_then_bytes(_GPT2_SPLIT), False),
    "smollm": (lambda: _split_then_bytes(r"\p{N}", _GPT2_SPLIT), False),  # every digit a piece of its own
    "llama-bpe": (lambda: _split_then_bytes(_LLAMA3_SPLIT), True),
    "qwen2": (lambda: _split_then_bytes(_QWEN2_SPLIT), False),
}

_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values llama.cpp matches whole in text


def supported_types() -> tuple[str, ...]:
    """Tensor types a weight may have: the float types, and every quantized type ``gguf`` dequantizes."""
    from gguf import quants

    return ("F32", "F16", *sorted({t.name for t in quants._type_traits} | {"BF16"}))


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


def find_gguf_file(path: Path) -> Path | None:
    """``path`` itself when it names a ``.gguf`` file; the one ``.gguf`` file in a directory without a
    ``config.json``; else None. A directory with several is ambiguous: name the file."""
    if is_gguf(path):
        return path
    if path.is_dir() and not (path / "config.json").exists():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise ValueError(f"model: {path} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}); "
                             "name the one to load")
        return files[0] if files else None
    return None


def open_reader(path: Path) -> gguf.GGUFReader:
    """The file opened with ``gguf``'s reader; a file it cannot read is a ``ValueError`` saying why."""
    import gguf

    if not path.is_file():
        raise ValueError(f"model: no such GGUF file: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"model: {path} is not a GGUF file (its first bytes are {magic!r}, not b'GGUF')")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader's errors for a cut or corrupt file are ValueError, IndexError, OSError...
        raise ValueError(f"model: cannot read GGUF file {path} (truncated or corrupt?): {type(e).__name__}: {e}") \
            from None


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def describe(path: Path) -> dict[str, Any]:
    """What the front processes need, as plain data: the cache holds exactly this (and the tokenizer file)."""
    reader = open_reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"model: GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    tensor_names = {t.name for t in reader.tensors}
    _check_tensor_types(reader)

    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{name}", default)

    tokens = _field(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"model: {path} has no tokenizer (tokenizer.ggml.tokens); we need one in the file")
    hf_config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "vocab_size": key("vocab_size") or len(tokens),
        "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": key("attention.head_count"),
        "num_key_value_heads": key("attention.head_count_kv"),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in tensor_names,
        "dtype": _checkpoint_dtype(_field(reader, "general.file_type")),
    }
    if key("attention.key_length"):
        hf_config["head_dim"] = key("attention.key_length")
    missing = [k for k, v in hf_config.items() if v is None]
    if missing:
        raise ValueError(f"model: {path} lacks the metadata for {', '.join(missing)}")
    scaling = key("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ValueError(f"model: GGUF rope scaling {scaling!r} is not supported (none, linear)")
        hf_config["rope_scaling"] = {"rope_type": "linear", "factor": key("rope.scaling.factor")}
    if "rope_freqs.weight" in tensor_names:  # Llama 3.1's frequency factors, written out as a tensor
        raise ValueError("model: GGUF files with rope_freqs (Llama 3.1+ RoPE scaling) are not supported yet; "
                         "load the Hugging Face checkpoint directory instead")

    special = {name: _field(reader, f"tokenizer.ggml.{name}_token_id") for name in ("bos", "eos", "eot", "eom")}
    eos_ids = sorted({i for name, i in special.items() if name != "bos" and i is not None})
    token_name = {name: tokens[i] if i is not None and i < len(tokens) else None for name, i in special.items()}
    return {
        "version": CACHE_VERSION,
        "hf_config": hf_config,
        "eos_token_ids": eos_ids,
        "bos_token": token_name["bos"],
        "eos_token": token_name["eos"],
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "tokenizer_json": _build_tokenizer(reader, tokens).to_str(),
    }


def _checkpoint_dtype(file_type: int | None) -> str:
    """llama.cpp's general.file_type: 0 all float32, 1 mostly float16, 32 bfloat16; a quantized file's
    dequantized weights are best kept in bfloat16 where a dtype is chosen for the device (a GPU)."""
    return {0: "float32", 1: "float16", 32: "bfloat16"}.get(file_type, "bfloat16")


def _check_tensor_types(reader: gguf.GGUFReader) -> None:
    supported = supported_types()
    bad = sorted({(t.tensor_type.name, t.name) for t in reader.tensors if t.tensor_type.name not in supported})
    if bad:
        type_name, tensor = bad[0]
        raise ValueError(f"model: GGUF tensor type {type_name} (tensor {tensor!r}) is not supported; supported: "
                         f"{', '.join(supported)}")


def _build_tokenizer(reader: gguf.GGUFReader, tokens: list[str]) -> HFTokenizer:
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"model: GGUF tokenizer {kind!r} is not supported; supported: 'gpt2' (byte-level BPE)")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"model: GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(PRE_TOKENIZERS)}")
    make_pre, ignore_merges = PRE_TOKENIZERS[pre]
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tok.pre_tokenizer = make_pre()
    tok.decoder = decoders.ByteLevel()
    token_types = _field(reader, "tokenizer.ggml.token_type") or []
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(token_types) if t == _CONTROL])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(token_types) if t == _USER_DEFINED])
    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    if _field(reader, "tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                           special_tokens=[(bos, bos_id)])
    return tok


def _cache_root() -> Path:
    root = os.environ.get("INFLIGHT_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "inflight") / "gguf"


def file_key(path: Path, version: int = CACHE_VERSION) -> str:
    """What names a file's converted copy in a cache: its path, size and modification time (a changed file gets
    a new key), and the version of what the copy holds."""
    stat = path.stat()
    key = f"{version}:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def cached_description(path: Path) -> dict[str, Any]:
    """``describe(path)``, converted once and kept in the cache (written atomically: concurrent starts of
    several processes never read a half-written entry)."""
    entry = _cache_root() / f"{file_key(path)}.json"
    if entry.exists():
        try:
            cached = json.loads(entry.read_text())
            if cached.get("version") == CACHE_VERSION:
                return cached
        except ValueError:
            pass  # a damaged entry is converted again
    logger.info("GGUF %s: converting its config and tokenizer once into %s", path.name, entry.parent)
    start = time.monotonic()
    description = describe(path)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=entry.parent, suffix=".tmp", delete=False) as tmp:
            json.dump(description, tmp)
        os.replace(tmp.name, entry)
    except OSError as e:  # a read-only home: the conversion is simply redone next time
        logger.warning("GGUF %s: cannot write the cache at %s (%s); converting at every start", path.name, entry, e)
    logger.info("GGUF %s: converted in %.1f s", path.name, time.monotonic() - start)
    return description


def read_gguf_source(path: Path):
    """The ``ModelSource`` of a GGUF file."""
    from inflight.engine.models.source import ModelSource

    description = cached_description(path)
    config = ModelConfig.from_hf(description["hf_config"])
    tokenizer = Tokenizer(HFTokenizer.from_str(description["tokenizer_json"]),
                          chat_template=description["chat_template"], bos_token=description["bos_token"],
                          eos_token=description["eos_token"])
    eos = set(description["eos_token_ids"])
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return ModelSource(str(path), config, tokenizer, frozenset(eos), weight_format="gguf")


# GGUF tensor names -> Hugging Face's (the loader's vocabulary); "{}" is the layer index.
_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{}.attn_norm": "model.layers.{}.input_layernorm",
    "blk.{}.ffn_norm": "model.layers.{}.post_attention_layernorm",
    "blk.{}.attn_q": "model.layers.{}.self_attn.q_proj",
    "blk.{}.attn_k": "model.layers.{}.self_attn.k_proj",
    "blk.{}.attn_v": "model.layers.{}.self_attn.v_proj",
    "blk.{}.attn_output": "model.layers.{}.self_attn.o_proj",
    "blk.{}.attn_q_norm": "model.layers.{}.self_attn.q_norm",
    "blk.{}.attn_k_norm": "model.layers.{}.self_attn.k_norm",
    "blk.{}.ffn_gate": "model.layers.{}.mlp.gate_proj",
    "blk.{}.ffn_up": "model.layers.{}.mlp.up_proj",
    "blk.{}.ffn_down": "model.layers.{}.mlp.down_proj",
}


def hf_tensor_name(name: str) -> str:
    base, _, suffix = name.rpartition(".")
    layer = None
    if base.startswith("blk."):
        _, layer, rest = base.split(".", 2)
        base = f"blk.{{}}.{rest}"
    if base not in _TENSOR_NAMES:
        raise ValueError(f"model: unexpected GGUF tensor {name!r}")
    return f"{_TENSOR_NAMES[base].format(layer)}.{suffix}"


def _unpermute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of Q/K rows: per head it interleaved the two rotary halves
    ([x0, x_half, x1, x_half+1, ...]); the model rotates halves ([x0, x1, ..., x_half, ...])."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def read_gguf_tensors(path: Path, config: ModelConfig,
                      keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor | QuantValues]]:
    """Every weight as (Hugging Face name, float32 tensor), dequantized and in the model's RoPE layout; with
    ``keep_quantized``, a weight of a type ``gguf_quant.KEPT_TYPES`` names comes as its ``QuantValues`` instead."""
    import numpy as np
    import torch
    from gguf import quants

    from inflight.engine.models import gguf_quant

    reader = open_reader(path)
    _check_tensor_types(reader)
    arch = _field(reader, "general.architecture")

    def kept(t) -> bool:
        shape = tuple(int(n) for n in t.shape)
        return (keep_quantized and t.tensor_type.name in gguf_quant.KEPT_TYPES and len(shape) == 2
                and shape[0] % 32 == 0)

    counts: dict[tuple[str, bool], int] = {}
    for t in reader.tensors:
        key = (t.tensor_type.name, kept(t))
        counts[key] = counts.get(key, 0) + 1
    described = [f"{n} {name}" + (" kept quantized" if keep else " dequantized") for (name, keep), n in
                 sorted(counts.items())]
    logger.info("GGUF %s: %d tensors (%s)", path.name, len(reader.tensors), ", ".join(described))
    heads = {"attn_q.weight": config.num_heads, "attn_k.weight": config.num_kv_heads}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        shape = tuple(int(n) for n in reversed(t.shape))  # ggml lists dimensions innermost first
        suffix = t.name.split(".", 2)[-1]
        permuted = arch in PERMUTED_QK and suffix in heads
        if kept(t):
            values = gguf_quant.read(t.data, t.tensor_type.name, shape)
            if permuted:
                values = values.rows(_unpermute(torch.arange(shape[0])[:, None], heads[suffix])[:, 0])
            yield hf_tensor_name(t.name), values
            continue
        array = quants.dequantize(t.data, t.tensor_type)
        # A copy: an F32 tensor's data is a view of the read-only file map.
        tensor = torch.from_numpy(np.array(array, dtype=np.float32)).reshape(shape)
        if permuted:
            tensor = _unpermute(tensor, heads[suffix])
        yield hf_tensor_name(t.name), tensor
