"""A request's answer from its replicas' messages: one JSON body (``full_response``) or SSE events (``sse``).

The bodies and events themselves are ``responses.py``'s; here the messages (``messages.Started``, ``Chunk``,
``Finished``) of each prompt are gathered or relayed, usage is counted, tool calls are read from a choice's text
when it ends, and an engine's timeout or abort becomes the client's error (a status before the first byte, an
error event after it).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from inflight.serve_app import responses as R
from inflight.serve_app.errors import APIError, RequestTimeoutError, ServiceUnavailableError
from inflight.serve_app.messages import GenerateRequest, Started, StreamEvent
from inflight.serve_app.migration import ReplicaLost

Messages = Callable[[GenerateRequest], AsyncIterator[StreamEvent]]  # one prompt's messages (migration.messages)


async def full_response(messages: Messages, requests: list[GenerateRequest], body, kind: str, model: str) -> dict:
    """Every prompt's whole answer, gathered concurrently, as OpenAI's one JSON body."""
    n = body.n
    tasks = [asyncio.ensure_future(_collect(messages(r), n)) for r in requests]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:  # one prompt failed (or we were cancelled): stop the others, which aborts them in the engine
        for task in tasks:
            task.cancel()
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()
    choices: list[R.ChoiceState] = []
    prompt_tokens = 0
    for i, task in enumerate(tasks):
        states, tokens = task.result()
        prompt_tokens += tokens
        for state in states:
            state.index = i * n + state.index
            choices.append(state)
    request_id = requests[0].request_id
    if kind == "chat":
        return R.chat_response(request_id, model, choices, prompt_tokens, body.logprobs, body.tool_reader())
    return R.completion_response(request_id, model, choices, prompt_tokens, body.logprobs is not None)


async def _collect(messages: AsyncIterator[StreamEvent], n: int) -> tuple[list[R.ChoiceState], int]:
    """One prompt's whole response (a replica lost on the way is replaced as for a stream: ``migration``)."""
    states = [R.ChoiceState(i) for i in range(n)]
    prompt_tokens = 0
    try:
        async for message in messages:
            if type(message) is Started:
                prompt_tokens = message.num_prompt_tokens
            for choice in message.choices:
                states[choice.index].add(choice)
    except ReplicaLost as e:
        raise ServiceUnavailableError(str(e), code="replica_lost") from None
    if any(s.finish_reason == "timeout" for s in states):
        raise RequestTimeoutError("request timed out (queueing, prefill and decode)", code="timeout")
    if any(s.finish_reason == "abort" for s in states):
        raise ServiceUnavailableError("request was aborted by the engine")
    return states, prompt_tokens


async def sse(messages: AsyncIterator[StreamEvent], first: Started, request_id: str, body, kind: str, model: str,
              usage: dict[str, int]) -> AsyncIterator[str]:
    """The SSE events of one streamed request (``first``: its first message, taken from ``messages`` already, so
    that an error before any byte is an HTTP status); ``usage`` gets its token counts as they come (the tenant's
    budget is settled from them when the stream ends). One write per replica message: its events are joined, and
    the last message's go out with the usage and ``[DONE]``, so a request costs the HTTP stack (uvicorn, Serve's
    ingress, Starlette) a send per message rather than per event: about 3 sends a request instead of 6."""
    created = int(time.time())
    prompt_tokens = first.num_prompt_tokens
    completion_tokens = 0
    text_offsets = [0] * body.n
    # Declared tools: the text is read for calls once a choice ends, so it is held back until then.
    tool_reader = body.tool_reader() if kind == "chat" else None
    held_text = [""] * body.n
    events: list[str] = []
    add = events.append
    chunks = _Prepended(first, messages)
    try:
        if kind == "chat":  # they go with the first message
            for i in range(body.n):
                add(R.sse(R.chat_chunk(request_id, model, created, i, {"role": "assistant", "content": ""},
                                       None, None)))
        async for message in chunks:
            for choice in message.choices:
                completion_tokens += len(choice.token_ids)
                usage["total_tokens"] = prompt_tokens + completion_tokens
                reason = choice.finish_reason
                if reason == "timeout":  # the engine ended it (and counted it)
                    raise RequestTimeoutError("request timed out (queueing, prefill and decode)", code="timeout")
                if reason == "abort":
                    raise ServiceUnavailableError("request was aborted by the engine")
                if not choice.text and not reason and not choice.logprobs:
                    continue
                if kind == "chat" and tool_reader is not None:
                    held_text[choice.index] += choice.text
                    if reason:
                        content, calls = tool_reader(held_text[choice.index])
                        delta = ({"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]} if calls
                                 else {"content": content or ""})
                        add(R.sse(R.chat_chunk(request_id, model, created, choice.index, delta, None, None)))
                        add(R.sse(R.chat_chunk(request_id, model, created, choice.index, {},
                                               R.finish_reason(reason, calls), None)))
                elif kind == "chat":
                    delta = {"content": choice.text} if choice.text or not reason else {}
                    logprobs = choice.logprobs if body.logprobs else None
                    add(R.sse(R.chat_chunk(request_id, model, created, choice.index, delta, reason, logprobs)))
                else:
                    add(R.sse(R.completion_chunk(request_id, model, created, choice, text_offsets[choice.index],
                                                 body.logprobs is not None)))
                    text_offsets[choice.index] += len(choice.text)
            # The last message (its stream ends right after it) waits for nothing: it goes out below.
            if events and not message.finished:
                yield "".join(events)
                events.clear()
        if body.include_usage():
            obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
            add(R.sse(R.usage_chunk(request_id, model, created, obj, prompt_tokens, completion_tokens)))
    except (APIError, ReplicaLost) as e:
        error = e if isinstance(e, APIError) else ServiceUnavailableError(str(e), code="replica_lost")
        add(R.sse(error.body()))
    finally:
        await chunks.aclose()
    add(R.sse("[DONE]"))
    yield "".join(events)


class ClosingStreamingResponse(StreamingResponse):
    """Closes its body when the response ends, however it ends. Starlette leaves a body that was cut off (a
    client gone while a chunk was being sent) suspended until it is garbage collected, and with it the replica
    call under it running: closing it cancels that call (which aborts the request in the engine) at once."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class _Prepended:
    """``first``, then ``rest``'s items. Closing it closes ``rest`` even before anything was taken (an async
    generator closed before it started runs no ``finally``, and ``rest``'s call would be left running)."""

    def __init__(self, first: Any, rest: AsyncIterator[Any]) -> None:
        self.first = first
        self.rest = rest

    def __aiter__(self) -> "_Prepended":
        return self

    async def __anext__(self) -> Any:
        if self.first is not None:
            first, self.first = self.first, None
            return first
        return await self.rest.__anext__()

    async def aclose(self) -> None:
        await self.rest.aclose()
