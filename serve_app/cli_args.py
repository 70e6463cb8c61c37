"""Command-line flags generated from the config classes (``EngineConfig``'s fields, ``AppConfig``'s), never
written twice: a field's flag is its name in kebab-case, its help the comment written beside the field, its
default the class's.

Flags default to ``argparse.SUPPRESS``, so the parsed namespace holds only what was given: the classes' own
defaults and validators then apply, and the same flags can override a serve config file. Bools are
``--flag/--no-flag``; a str field takes the text as given; any other field takes JSON (``--max-model-len 4096``,
``--max-queue-wait-s null``, ``--speculative-config '{"method": "ngram"}'``), or the text as a string where it
is not JSON (``--num-replicas auto``).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterable
from typing import Any


@dataclasses.dataclass(frozen=True)
class ConfigField:
    """One field of a config class, as a flag shows it."""

    name: str
    annotation: Any
    default: Any
    comment: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def dataclass_fields(cls: type) -> list[ConfigField]:
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    return [ConfigField(f.name, hints[f.name],
                        f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default,
                        comments.get(f.name, "")) for f in dataclasses.fields(cls)]


def pydantic_fields(cls: type) -> list[ConfigField]:
    comments = field_comments(cls)
    return [ConfigField(name, info.annotation, info.get_default(call_default_factory=True),
                        info.description or comments.get(name, "")) for name, info in cls.model_fields.items()]


def field_comments(cls: type) -> dict[str, str]:
    """The comment written with each field in ``cls``'s source: on its line, else the comment lines just above."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments = {token.start[0]: (token.string.lstrip("#").strip(), token.line.lstrip().startswith("#"))
                for token in tokenize.generate_tokens(io.StringIO(source).readline) if token.type == tokenize.COMMENT}
    found = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        parts = [text for line in range(node.lineno, node.end_lineno + 1)
                 for text, whole_line in [comments.get(line, ("", True))] if not whole_line]
        trailing = bool(parts)
        line = node.lineno - 1
        while not trailing and comments.get(line, ("", False))[1]:  # else the block of comment lines above
            parts.insert(0, comments[line][0])
            line -= 1
        found[node.target.id] = " ".join(parts)
    return found


def _members(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _is_bool(annotation: Any) -> bool:
    return all(member in (bool, type(None)) for member in _members(annotation))


def _takes_text(annotation: Any) -> bool:
    return str in _members(annotation)


def parse_value(text: str) -> Any:
    """A flag's value: JSON, or the text itself where it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def format_default(value: Any) -> str:
    """A default as a user would type it: strings as they are, the rest as JSON."""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _metavar(annotation: Any) -> str:
    literals = [value for member in _members(annotation) if typing.get_origin(member) is typing.Literal
                for value in typing.get_args(member)]
    plain = [member.__name__ for member in _members(annotation)
             if member in (int, float, str)]
    if literals or plain:
        return "{" + ",".join([*plain, *map(str, literals)]) + "}" if literals else "|".join(plain).upper()
    return "JSON"


def add_config_flags(group: argparse._ArgumentGroup, config_fields: Iterable[ConfigField]) -> None:
    for field in config_fields:
        help_text = f"{field.comment} (default: {format_default(field.default)})".lstrip()
        help_text = help_text.replace("%", "%%")
        if _is_bool(field.annotation):
            group.add_argument(field.flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=help_text)
        else:
            group.add_argument(field.flag, type=str if _takes_text(field.annotation) else parse_value,
                               metavar=_metavar(field.annotation), default=argparse.SUPPRESS, help=help_text)


def given(namespace: argparse.Namespace, config_fields: Iterable[ConfigField]) -> dict[str, Any]:
    """The fields whose flags were given, by field name."""
    return {field.name: getattr(namespace, field.name) for field in config_fields if hasattr(namespace, field.name)}
