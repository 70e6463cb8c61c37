"""Tool calling for chat completions: OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls``.

- ``required`` and a named function are enforced with structured outputs: the model can only write a valid call
  (``required``: a JSON array of ``{"name", "arguments"}`` objects, one per call, each ``arguments`` matching its
  function's parameters schema; a named function: its arguments object), which becomes ``message.tool_calls``.
- ``auto`` lets the model write what it wants; the text is then read for the calls the common model families
  write (Hermes / Qwen ``<tool_call>{...}</tool_call>``, Mistral ``[TOOL_CALLS][...]``, Llama 3's bare
  ``{"name": ..., "parameters": ...}``); only calls to declared functions count, the rest stays content.
- ``none`` (and no tools): plain text.

The tools also go to the chat template (templates that take ``tools`` render them into the prompt).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator

MAX_TOOLS = 128
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value):
        if not NAME.match(value):
            raise ValueError("must be 1-64 letters, digits, underscores or dashes")
        return value

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, value):
        if value is not None and value.get("type", "object") != "object":
            raise ValueError("must be a JSON schema of type object")
        return value

    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters or {"type": "object", "properties": {}}


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
ToolList = list[Tool]


def check_tools(tools: list[Tool] | None, tool_choice: ToolChoice | None) -> None:
    """What pydantic cannot check field by field: names unique and known, a choice that needs tools has them."""
    tools = tools or []
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools: at most {MAX_TOOLS}, got {len(tools)}")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError("tools: function names must be unique")
    if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
        raise ValueError(f"tool_choice: no tool is named {tool_choice.function.name[:64]!r}")
    if tool_choice == "required" and not tools:
        raise ValueError("tool_choice: 'required' needs tools")


def forced_constraint(tools: list[Tool], tool_choice: ToolChoice | None, parallel: bool) -> dict[str, Any] | None:
    """The structured output that makes ``required`` or a named choice a valid call, or None (auto, none)."""
    if isinstance(tool_choice, NamedToolChoice):
        [tool] = [t for t in tools if t.function.name == tool_choice.function.name]
        return {"kind": "json", "spec": tool.function.arguments_schema()}
    if tool_choice != "required":
        return None
    call = {"anyOf": [{"type": "object",
                       "properties": {"name": {"const": t.function.name}, "arguments": t.function.arguments_schema()},
                       "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}
    array: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return {"kind": "json", "spec": array}


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """One entry of ``message.tool_calls``."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def read_calls(text: str, tools: list[Tool], tool_choice: ToolChoice | None) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a finished generation. Forced calls were constrained to parse; an ``auto``
    generation is searched for the formats in the module docstring."""
    if isinstance(tool_choice, NamedToolChoice):
        return None, [tool_call(tool_choice.function.name, text)]
    if tool_choice == "required":
        try:
            calls = json.loads(text)
        except ValueError:  # cut by max_tokens before the JSON closed
            return None, _cut_calls(text)
        return None, [tool_call(c["name"], c["arguments"]) for c in calls]
    if not tools or tool_choice == "none":
        return text, []
    return _read_auto(text, {t.function.name for t in tools})


_CALL_START = re.compile(r'\{"name":\s*"((?:[^"\\]|\\.)*)",\s*"arguments":\s*')


def _cut_calls(text: str) -> list[dict]:
    """The calls of a ``required`` array cut short by the token budget, as OpenAI returns a cut call: each call
    whose name was written, with its arguments whole where they closed, else as far as they got (not yet valid
    JSON). The grammar writes ``name`` before ``arguments``, so each call starts as ``_CALL_START``."""
    calls = []
    for start in _CALL_START.finditer(text):
        rest = text[start.end():]
        try:
            _, end = json.JSONDecoder().raw_decode(rest)
            arguments = rest[:end]
        except ValueError:  # the one the budget cut
            arguments = rest
        calls.append(tool_call(json.loads(f'"{start.group(1)}"'), arguments))
    return calls


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_MISTRAL = "[TOOL_CALLS]"


def _read_auto(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    def as_call(obj: Any) -> dict | None:
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return None
        arguments = obj.get("arguments", obj.get("parameters", {}))
        return tool_call(obj["name"], arguments) if isinstance(arguments, (dict, str)) else None

    def loads(piece: str) -> Any:
        try:
            return json.loads(piece)
        except ValueError:
            return None

    blocks = _HERMES.findall(text)
    if blocks:
        calls = [c for c in (as_call(loads(b)) for b in blocks) if c is not None]
        if calls:
            content = _HERMES.sub("", text).strip()
            return content or None, calls
    if _MISTRAL in text:
        head, _, tail = text.partition(_MISTRAL)
        found = loads(tail.strip())
        items = found if isinstance(found, list) else [found]
        calls = [c for c in (as_call(item) for item in items) if c is not None]
        if calls:
            return head.strip() or None, calls
    stripped = text.strip().removeprefix("<|python_tag|>")
    found = loads(stripped)
    items = found if isinstance(found, list) else [found]
    calls = [c for c in (as_call(item) for item in items) if c is not None] if found is not None else []
    if calls and len(calls) == len(items):
        return None, calls
    return text, []


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as chat templates take them (OpenAI's shape, plain dicts)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None

