"""``demo-tiny``: a built-in Llama-architecture model with RANDOM weights and a byte-level tokenizer.

It needs no files and no downloads, so ``make run`` and the tests work anywhere. Its weights are
random (seeded, so every run is the same): the text it writes is noise. It exists to exercise
the engine and the server, not to say anything. Point ``model`` at a real checkpoint for that.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

from inflight.engine.models.config import ModelConfig
from inflight.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from inflight.engine.models.llama import CausalLM

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
WEIGHT_SEED = 1234


@functools.lru_cache(maxsize=1)
def build_tokenizer() -> Tokenizer:
    """Byte-level: every byte is a token, so any text encodes; ids 0-6 are the special tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in sorted(alphabet):
        vocab[char] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A $B", special_tokens=[("<|bos|>", 1)])
    return Tokenizer(tok, chat_template=CHAT_TEMPLATE, bos_token="<|bos|>", eos_token="<|eos|>")


def model_config() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=len(SPECIAL_TOKENS) + 256, hidden_size=128,
        intermediate_size=352, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=4096, tie_word_embeddings=False,
        qkv_bias=False, o_bias=False, qk_norm=False, sliding_window=None, torch_dtype="float32",
    )


def source():
    from inflight.engine.models.source import DEMO_TINY, ModelSource

    tokenizer = build_tokenizer()
    return ModelSource(DEMO_TINY, model_config(), tokenizer, frozenset({tokenizer.eos_token_id}),
                       weight_format="builtin")


def init_weights(model: CausalLM) -> None:
    """Deterministic random weights: the same on every machine, whatever the device or dtype."""
    import torch  # here: the tokenizer and config above serve processes that never load the model

    generator = torch.Generator().manual_seed(WEIGHT_SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                value = torch.ones(param.shape)
            elif name.endswith("embed_tokens.weight"):
                value = torch.randn(param.shape, generator=generator)
            else:
                value = torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5
            param.copy_(value.to(param.dtype))
