"""OpenAI response bodies and SSE chunks, built as plain dicts (cheap on the streaming hot path).

Required-but-null fields (``logprobs``, ``message.refusal``...) are always present,
so responses validate against the official OpenAPI description.
"""

from __future__ import annotations

import base64
import json
import struct
import time
from typing import Any, Callable

from inflight.serve_app.messages import Choice

FINISH_REASONS = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}  # "abort"/"timeout" never reach a 200 body


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(entries: list[dict[str, Any]], text_offset_start: int) -> dict[str, Any]:
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset_start
    for entry in entries:
        tokens.append(entry["token"])
        token_logprobs.append(entry["logprob"])
        # None for an echoed prompt's first token: nothing before it, so no logprob (OpenAI sends null)
        top_logprobs.append({text: logprob for text, logprob in entry["top"]} if entry["top"] is not None else None)
        offsets.append(offset)
        offset += len(entry["token"])
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    def item(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [{**item(e["token"], e["logprob"]), "top_logprobs": [item(t, lp) for t, lp in e["top"]]}
               for e in entries]
    return {"content": content, "refusal": None}


class ChoiceState:
    """What one choice has accumulated (text, tokens, logprobs) while a request runs."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.num_tokens = 0
        self.logprobs: list[dict[str, Any]] = []
        self.finish_reason: str | None = None

    def add(self, choice: Choice) -> None:
        self.text += choice.text
        self.num_tokens += len(choice.token_ids)
        self.logprobs.extend(choice.logprobs or [])
        if choice.finish_reason is not None:
            self.finish_reason = choice.finish_reason


def completion_response(request_id: str, model: str, choices: list[ChoiceState], prompt_tokens: int,
                        with_logprobs: bool) -> dict[str, Any]:
    return {
        "id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": c.index, "text": c.text, "finish_reason": FINISH_REASONS.get(c.finish_reason, "stop"),
                     "logprobs": completion_logprobs(c.logprobs, 0) if with_logprobs else None} for c in choices],
        "usage": usage(prompt_tokens, sum(c.num_tokens for c in choices)),
    }


def finish_reason(engine_reason: str | None, calls: list) -> str:
    """OpenAI's finish reason of a chat choice: "length" whenever the token budget cut it (a call among ``calls``
    may then be cut too), else "tool_calls" when it made calls."""
    if calls and engine_reason != "length":
        return "tool_calls"
    return FINISH_REASONS.get(engine_reason, "stop")


def chat_response(request_id: str, model: str, choices: list[ChoiceState], prompt_tokens: int,
                  with_logprobs: bool, tool_reader: Callable[[str], tuple[str | None, list]] | None = None
                  ) -> dict[str, Any]:
    """``tool_reader``: text -> (content, tool calls), when the request declared tools (serve_app.tools)."""
    def message_and_reason(c: ChoiceState) -> tuple[dict[str, Any], str]:
        content, calls = tool_reader(c.text) if tool_reader is not None else (c.text, [])
        message = {"role": "assistant", "content": content, "refusal": None, "annotations": []}
        reason = finish_reason(c.finish_reason, calls)
        return ({**message, "tool_calls": calls} if calls else message), reason

    answers = [(c, *message_and_reason(c)) for c in choices]
    return {
        "id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": c.index, "message": message, "finish_reason": reason,
                     "logprobs": chat_logprobs(c.logprobs) if with_logprobs else None} for c, message, reason in answers],
        "usage": usage(prompt_tokens, sum(c.num_tokens for c in choices)),
    }


def completion_chunk(request_id: str, model: str, created: int, choice: Choice, text_offset: int,
                     with_logprobs: bool) -> dict[str, Any]:
    return {
        "id": request_id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": choice.index, "text": choice.text,
                     "finish_reason": FINISH_REASONS.get(choice.finish_reason) if choice.finish_reason else None,
                     "logprobs": completion_logprobs(choice.logprobs or [], text_offset)
                     if with_logprobs else None}],
    }


def chat_chunk(request_id: str, model: str, created: int, index: int, delta: dict[str, Any],
               finish_reason: str | None, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {
        "id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": index, "delta": delta,
                     "finish_reason": FINISH_REASONS.get(finish_reason) if finish_reason else None,
                     "logprobs": chat_logprobs(logprobs) if logprobs is not None else None}],
    }


def usage_chunk(request_id: str, model: str, created: int, obj: str, prompt_tokens: int,
                completion_tokens: int) -> dict[str, Any]:
    return {"id": request_id, "object": obj, "created": created, "model": model,
            "choices": [], "usage": usage(prompt_tokens, completion_tokens)}


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


def pack_embedding(values: list[float]) -> bytes:
    """An embedding as little-endian float32 bytes: how replicas send it, and what base64 encoding_format encodes."""
    return struct.pack(f"<{len(values)}f", *values)


def embedding_response(model: str, embeddings: list[bytes], prompt_tokens: int, encoding_format: str) -> dict[str, Any]:
    """OpenAI's embeddings list; each embedding is a list of floats, or base64 of its float32 bytes."""
    def encode(packed: bytes) -> list[float] | str:
        if encoding_format == "base64":
            return base64.b64encode(packed).decode("ascii")
        return list(struct.unpack(f"<{len(packed) // 4}f", packed))

    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(e)} for i, e in enumerate(embeddings)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
