"""OpenAI-compatible request schemas (pydantic, at the HTTP edge) and their translation for the engine.

Completions take ``echo`` (the prompt before the text; with ``logprobs``, the prompt tokens' logprobs first)
and ``max_tokens: 0`` with it (prompt scoring: nothing is generated). Embeddings take OpenAI's request.

We accept OpenAI's parameters (penalties and ``logit_bias`` included) and vLLM's extensions (``top_k``,
``min_p``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``priority``, ``repetition_penalty``) plus our own
``timeout`` (seconds). OpenAI parameters we do not
implement are accepted only at their neutral value, so a request never silently means something else.
Unknown fields are rejected, as the OpenAI API does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from inflight.engine.sampling_params import MAX_LOGIT_BIAS
from inflight.serve_app.tools import Tool, ToolChoice, check_tools, forced_constraint, read_calls

MAX_N = 16
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's own limit on inputs per request
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 1000  # a stop list is searched at every token: bounded
MAX_STOP_TOKEN_IDS = 64
MAX_MESSAGES, MAX_CONTENT_PARTS = 2048, 256
MAX_TIMEOUT_S = 24 * 3600.0


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_obfuscation: bool | None = None


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias in [-100, 100]
    # vLLM's extensions
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    # What the output must match: OpenAI's response_format, vLLM's structured_outputs, or vLLM's older guided_*.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    _constraint: dict[str, Any] | None = PrivateAttr(default=None)  # the one of them given, for the engine
    # ours: a deadline in seconds covering queueing, prefill and decode
    timeout: float | None = Field(default=None, gt=0.0, le=MAX_TIMEOUT_S)

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop strings may be at most {MAX_STOP_CHARS} characters long")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value):
        if not value:
            return value
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"may hold at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
        for key, bias in value.items():
            if not (key.isascii() and key.isdigit()):  # "²".isdigit() holds, and int("²") fails
                raise ValueError(f"keys must be token ids (non-negative integers), got {key[:20]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {bias!r} for token {key}")
        return value

    @model_validator(mode="after")
    def _one_constraint(self):
        found = [c for c in (_from_response_format(self.response_format), _from_structured_outputs(self.structured_outputs),
                             _from_guided(self)) if c is not None]
        if len(found) > 1:
            raise ValueError("only one of response_format, structured_outputs and guided_* may constrain the output")
        self._constraint = found[0] if found else None
        return self

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_kwargs(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        """Keyword arguments for ``engine.SamplingParams`` (which checks them again, once, for everyone)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return {
            "n": self.n,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": self.top_k or 0,
            "min_p": self.min_p or 0.0,
            "seed": self.seed,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "stop": stops,
            "stop_token_ids": list(self.stop_token_ids or []),
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": 1.0 if self.repetition_penalty is None else self.repetition_penalty,
            "logit_bias": {int(k): v for k, v in (self.logit_bias or {}).items()},
            "structured_output": self._constraint,
        }


def _from_response_format(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's response_format as the engine's structured output ({"kind", "spec"}), or None for text."""
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"kind": "json_object", "spec": None}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format: json_schema needs {\"name\": ..., \"schema\": {...}}")
        return {"kind": "json", "spec": schema}
    raise ValueError(f"response_format: type must be text, json_object or json_schema, got {str(kind)[:40]!r}")


STRUCTURED_KINDS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def _from_structured_outputs(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's structured_outputs: exactly one of json (a schema), regex, choice, grammar, or json_object: true."""
    if not value:
        return None
    if value.get("json_object") is True and len(value) == 1:
        return {"kind": "json_object", "spec": None}
    keys = [k for k in value if value[k] is not None]
    if len(keys) != 1 or keys[0] not in STRUCTURED_KINDS:
        raise ValueError(f"structured_outputs: give exactly one of {', '.join(STRUCTURED_KINDS)} (or json_object: "
                         f"true), got {', '.join(k[:20] for k in keys) or 'none'}")
    return {"kind": STRUCTURED_KINDS[keys[0]], "spec": value[keys[0]]}


def _from_guided(request: "_Sampling") -> dict[str, Any] | None:
    """vLLM's older names: guided_json, guided_regex, guided_choice, guided_grammar."""
    given = {kind: getattr(request, f"guided_{kind}") for kind in ("json", "regex", "choice", "grammar")}
    given = {kind: spec for kind, spec in given.items() if spec is not None}
    if len(given) > 1:
        raise ValueError(f"give one of guided_json, guided_regex, guided_choice, guided_grammar, not "
                         f"{', '.join('guided_' + k for k in given)}")
    if not given:
        return None
    [(kind, spec)] = given.items()
    return {"kind": kind, "spec": spec}


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False  # before max_tokens: its validator reads it
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, value):
        if value == "" or value == [] or value == [[]]:
            raise ValueError("must not be empty")
        return value

    @field_validator("max_tokens")
    @classmethod
    def _zero_needs_echo(cls, value, info: ValidationInfo):
        if value == 0 and not info.data.get("echo"):
            raise ValueError("may be 0 only with echo=true (scoring the prompt: nothing is generated, the prompt "
                             "and, with logprobs, its tokens' logprobs come back)")
        return value

    def completion_sampling_kwargs(self) -> dict[str, Any]:
        """``sampling_kwargs`` for this request: with ``echo``, ``logprobs`` also asks for the prompt's
        (``prompt_logprobs``); with ``max_tokens: 0`` only for the prompt's."""
        kwargs = self.sampling_kwargs(self.max_tokens, self.logprobs if self.max_tokens != 0 else None)
        if self.echo and self.logprobs is not None:
            kwargs["prompt_logprobs"] = self.logprobs
        return kwargs

    @model_validator(mode="after")
    def _unsupported(self):
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of not in (None, 1, self.n):
            raise ValueError("best_of is not supported by this server")
        return self

    def prompts(self) -> list[str | list[int]]:
        return _prompt_list(self.prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = Field(default=None)

    @field_validator("content")
    @classmethod
    def _bounded_parts(cls, value):
        if isinstance(value, list) and len(value) > MAX_CONTENT_PARTS:
            raise ValueError(f"at most {MAX_CONTENT_PARTS} content parts per message, got {len(value)}")
        return value
    name: str | None = None

    def text(self) -> str:
        """Text content; parts of type text are joined (other parts are not supported)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"content part of type {part.get('type')!r} is not supported (only text)")
            texts.append(str(part.get("text", "")))
        return "".join(texts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _unsupported(self):
        check_tools(self.tools, self.tool_choice)
        forced = forced_constraint(self.tools or [], self.tool_choice, self.parallel_tool_calls is not False)
        if forced is not None:
            if self._constraint is not None:
                raise ValueError("tool_choice 'required' or a named function cannot be combined with response_format, "
                                 "structured_outputs or guided_* (it constrains the output itself)")
            self._constraint = forced
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def plain_messages(self) -> list[dict[str, Any]]:
        """The messages as chat templates take them: role and text, and an assistant's ``tool_calls``, a tool
        result's ``tool_call_id`` and ``name`` where given."""
        return [{"role": m.role, "content": m.text(),
                 **{k: v for k in ("tool_calls", "tool_call_id", "name") if (v := getattr(m, k, None)) is not None}}
                for m in self.messages]

    def reads_tool_calls(self) -> bool:
        """Whether the generated text is read for tool calls (then it is not streamed as it comes)."""
        return bool(self.tools) and self.tool_choice != "none"

    def tool_reader(self):
        """text -> (content, tool calls), or None when no tools apply."""
        if not self.reads_tool_calls():
            return None
        tools, choice = self.tools, self.tool_choice
        return lambda text: read_calls(text, tools, choice)


class EmbeddingRequest(BaseModel):
    """OpenAI's ``POST /v1/embeddings``: one embedding per input (a string or token ids), the mean over its
    positions of the model's final-norm hidden state."""

    model_config = ConfigDict(extra="forbid")

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # ours: a deadline in seconds covering queueing and the forward
    timeout: float | None = Field(default=None, gt=0.0, le=MAX_TIMEOUT_S)

    @field_validator("input")
    @classmethod
    def _inputs(cls, value):
        items = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else value
        if not items or any(len(item) == 0 for item in items):
            raise ValueError("must not be empty, nor hold an empty string or an empty list of token ids")
        if len(items) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"holds {len(items)} inputs; at most {MAX_EMBEDDING_INPUTS} per request")
        return value

    @field_validator("dimensions")
    @classmethod
    def _no_dimensions(cls, value):
        if value is not None:
            raise ValueError("is not supported by this server (embeddings have the model's hidden size)")
        return value

    def inputs(self) -> list[str | list[int]]:
        return _prompt_list(self.input)


def _prompt_list(value: str | list) -> list[str | list[int]]:
    """OpenAI's prompt (or embeddings input) as a list of prompts: a string, strings, token ids, or lists of
    token ids."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(t, int) for t in value):
        return [list(value)]
    return list(value)


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize`` (benchmark clients probe it to align prompt lengths): a prompt, or chat
    messages rendered with the model's chat template."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self

    def payload(self) -> dict[str, Any]:
        """What the replica's ``tokenize`` takes."""
        if self.messages is not None:
            return {"messages": [{"role": m.role, "content": m.text()} for m in self.messages],
                    "add_generation_prompt": self.add_generation_prompt, "return_token_strs": self.return_token_strs}
        return {"prompt": self.prompt, "add_special_tokens": self.add_special_tokens,
                "return_token_strs": self.return_token_strs}


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``: token ids back to text."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)
