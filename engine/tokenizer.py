"""Text <-> token ids through the ``tokenizers`` library, and chat templates through jinja2."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


class Tokenizer:
    """A fast tokenizer plus what ``tokenizer_config.json`` adds: special tokens and the chat template."""

    def __init__(self, tokenizer: HFTokenizer, *, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None) -> None:
        self._tokenizer = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_id = tokenizer.token_to_id(eos_token) if eos_token else None
        self.chat_template = chat_template
        self._template = None
        if chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(chat_template)

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.exists():
            raise ValueError(f"model: no tokenizer.json in {path}")
        config: dict[str, Any] = {}
        if (path / "tokenizer_config.json").exists():
            config = json.loads((path / "tokenizer_config.json").read_text())
        chat_template = config.get("chat_template")
        if isinstance(chat_template, list):  # several named templates: take the default one
            chat_template = next((t["template"] for t in chat_template if t.get("name") == "default"), None)
        if chat_template is None and (path / "chat_template.jinja").exists():
            chat_template = (path / "chat_template.jinja").read_text()
        return cls(HFTokenizer.from_file(str(file)), chat_template=chat_template,
                   bos_token=_token_text(config.get("bos_token")), eos_token=_token_text(config.get("eos_token")))

    @property
    def backend(self) -> HFTokenizer:
        """The ``tokenizers`` object itself (structured outputs read its vocabulary and decoder)."""
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # `tokenizers` refuses a str that is not Unicode text (a lone surrogate, "\ud800")
            if isinstance(text, str) and not _is_unicode(text):
                raise ValueError("prompt: holds a lone UTF-16 surrogate (U+D800-U+DFFF), which is not Unicode "
                                 "text") from None
            raise

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tokenizer.id_to_token(token_id)

    def decode_stream(self, skip_special_tokens: bool = True) -> "IncrementalDecoder":
        return IncrementalDecoder(self._tokenizer, skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        if self._template is None:
            raise ValueError("messages: this model has no chat template; send a plain prompt instead")
        if not messages:
            raise ValueError("messages must not be empty")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except jinja2.TemplateError as e:
            raise ValueError(f"messages: the chat template rejected them: {e}") from e

    def chat_prompt(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """A conversation as the engine's prompt: the template's text and its token ids. The template writes
        the special tokens (bos) itself, so encoding does not add them again; ``tools`` (OpenAI's shape) go to
        templates that render them."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        return {"prompt": text, "prompt_token_ids": self.encode(text, add_special_tokens=False)}


class IncrementalDecoder:
    """Turns a growing list of ids into text pieces, never splitting a multi-byte character."""

    def __init__(self, tokenizer: HFTokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tokenizer, token_id) or ""


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
