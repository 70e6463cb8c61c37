"""Small GGUF files for the tests, written with ``gguf``'s own writer the way llama.cpp's converter writes them:
a random Hugging Face checkpoint (``tests.checkpoints``) with demo-tiny's byte-level vocabulary, its weights in a
chosen tensor type, Q and K of Llama-architecture models permuted for ggml's RoPE."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from inflight.engine.models.demo_tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tokenizer
from tests.checkpoints import make_checkpoint

GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_NAMES = {  # Hugging Face's -> GGUF's
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    base, _, suffix = hf_name.rpartition(".")
    if base.startswith("model.layers."):
        _, _, layer, rest = base.split(".", 3)
        return f"blk.{layer}.{_NAMES[rest]}.{suffix}"
    return f"{_NAMES[base]}.{suffix}"


def permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter's permute of Q/K rows (each head's two rotary halves interleaved)."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def write_gguf(path: Path, arch: str = "llama", tensor_type: str = "F32", seed: int = 0,
               raw_tensors: dict[str, tuple[np.ndarray, str]] | None = None, tokenizer_pre: str = "default",
               tokenizer_model: str = "gpt2", tensor_types: dict[str, str] | None = None, **overrides) -> Path:
    """A random ``arch`` model as a GGUF file at ``path`` (its Hugging Face checkpoint beside it, in
    ``path.parent / "hf"``); 2-D weights in ``tensor_type``, norms in F32 as llama.cpp keeps them.
    ``raw_tensors``: more tensors, as (bytes, GGUF type name), written as they are. ``tensor_types``: another type
    for the 2-D weights whose Hugging Face name contains a key (``{"v_proj": "Q8_0"}``), as llama.cpp's mixes do."""
    import gguf
    from gguf import quants
    from safetensors.torch import load_file

    if arch == "llama":
        overrides.setdefault("rope_scaling", None)  # llama3 RoPE goes in a rope_freqs tensor, not supported yet
    hf_dir = make_checkpoint(path.parent / "hf", arch, seed=seed, **overrides)
    config = json.loads((hf_dir / "config.json").read_text())
    weights = load_file(str(hf_dir / "model.safetensors"))
    qtype = gguf.GGMLQuantizationType[tensor_type]
    writer = gguf.GGUFWriter(str(path), GGUF_ARCH[arch])
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(float(config.get("rope_theta") or config["rope_parameters"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    write_tokenizer(writer, tokenizer_pre, tokenizer_model)
    for hf_name, tensor in weights.items():
        if config.get("tie_word_embeddings") and hf_name == "lm_head.weight":
            continue
        array = tensor.float().numpy()
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            array = permute(array, heads if "q_proj" in hf_name else kv_heads)
        this_type = next((gguf.GGMLQuantizationType[t] for part, t in (tensor_types or {}).items()
                          if part in hf_name), qtype)
        if array.ndim == 2 and this_type != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(hf_name), quants.quantize(array, this_type), raw_dtype=this_type)
        else:
            writer.add_tensor(gguf_name(hf_name), np.ascontiguousarray(array, dtype=np.float32))
    for name, (data, type_name) in (raw_tensors or {}).items():
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tokenizer(writer, pre: str = "default", model: str = "gpt2") -> None:
    """demo-tiny's byte-level vocabulary: its special tokens (CONTROL), then one token per byte, no merges."""
    vocab = build_tokenizer().backend.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)
