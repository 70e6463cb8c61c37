"""From an HTTP body to the typed requests a replica takes: parsing and checking (400s), seeds, reservations.

A body is parsed and validated here (OpenAI's 400 with the offending ``param``, never FastAPI's 422), then one
``GenerateRequest`` is built per prompt (a completions call may carry several), each sampled one seeded so that
it can be continued on another replica exactly.
"""

from __future__ import annotations

import json
import secrets
import uuid
from typing import Any

from pydantic import ValidationError
from starlette.requests import ClientDisconnect, Request

from inflight.serve_app.errors import BadRequestError, ModelNotFoundError
from inflight.serve_app.messages import GenerateRequest
from inflight.serve_app.tools import template_tools


async def parse_body(http: Request, schema: type):
    """The request's body as ``schema`` (a pydantic model); raises ``BadRequestError``."""
    try:
        raw = await http.body()
    except ClientDisconnect:  # gone before its body arrived: nobody to answer, nothing to log as an error
        raise BadRequestError("the client disconnected before sending the whole request body") from None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadRequestError(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequestError("request body must be a JSON object")
    reject_lone_surrogates(data)
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        message = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()[:5])
        raise BadRequestError(message, param=param) from None


def check_model(requested: str | None, served: str) -> None:
    if requested != served:
        raise ModelNotFoundError(f"model {requested!r} does not exist; this server serves {served!r}",
                                 param="model", code="model_not_found")


def reject_lone_surrogates(data: Any) -> None:
    """JSON's "\\ud800" escapes can make a str that is not Unicode text (a lone surrogate): no tokenizer takes
    it, so it is a 400 here, wherever it is in the body. Iterative: a body can nest deep."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise BadRequestError("request body holds a lone UTF-16 surrogate (U+D800-U+DFFF), which is not "
                                      "Unicode text") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def seeded(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with a seed of the router's when the client gave none: a sampled request can then be continued
    on another replica exactly (its draws are a function of the seed and the output position)."""
    return params if params.get("seed") is not None else {**params, "seed": secrets.randbits(63)}


def tokens_to_reserve(body, kind: str) -> int:
    """A request's tokens before they are known: its prompts at ~4 characters a token (token ids as they are)
    and its output bound (``max_tokens``, else 256), for each of its ``n`` choices; an embedding's inputs alone."""
    if kind == "chat":
        prompts = ["".join(str(m.content or "") for m in body.messages)]
        max_tokens = body.max_new_tokens()
    elif kind == "embedding":
        prompts, max_tokens = body.inputs(), 0
    else:
        prompts = body.prompts()
        max_tokens = body.max_tokens
    prompt_tokens = sum(len(p) if isinstance(p, list) else len(p) // 4 + 1 for p in prompts)
    return prompt_tokens + len(prompts) * getattr(body, "n", 1) * (max_tokens if max_tokens is not None else 256)


def generate_requests(body, kind: str, tenant: str | None = None, tokenizer=None) -> list[GenerateRequest]:
    """One replica request per prompt (a completions call may carry several). A request of a tenant (an API
    key's) says so: the engine salts its prefix cache by tenant (tenants never share cached blocks) and, under the
    fair policy, shares its queue between tenants. ``tokenizer``: the model's, when routing hashes the prompt's
    tokens (prefix affinity); the replica then takes the ids as they are."""
    salt = {"tenant": tenant} if tenant is not None else {}  # the engine salts the tenant's cache with it
    base_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
    client_timeout = body.timeout is not None
    if kind == "chat":
        try:
            messages = body.plain_messages()
        except ValueError as e:
            raise BadRequestError(str(e), param="messages") from None
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = seeded({**body.sampling_kwargs(body.max_new_tokens(), logprobs), **salt})
        tools = template_tools(body.tools)
        prompt_text = prompt_token_ids = None
        if tokenizer is not None:
            try:
                prompt = tokenizer.chat_prompt(messages, body.add_generation_prompt, tools)
            except ValueError as e:
                raise BadRequestError(str(e), param="messages") from None
            prompt_text, prompt_token_ids = prompt["prompt"], prompt["prompt_token_ids"]
        return [GenerateRequest(base_id, "chat", params, messages=messages,
                                add_generation_prompt=body.add_generation_prompt, tools=tools, priority=body.priority,
                                client_timeout=client_timeout, prompt_text=prompt_text,
                                prompt_token_ids=prompt_token_ids)]
    params = {**body.completion_sampling_kwargs(), **salt}
    requests = []
    for i, prompt in enumerate(body.prompts()):
        text = prompt if isinstance(prompt, str) else None
        token_ids = None
        if tokenizer is not None:
            token_ids = tokenizer.encode(prompt) if text is not None else prompt
        requests.append(GenerateRequest(base_id if i == 0 else f"{base_id}-{i}", "completion", seeded(params),
                                        prompt=prompt, echo=body.echo, priority=body.priority,
                                        client_timeout=client_timeout,
                                        prompt_text=text if tokenizer is not None else None,
                                        prompt_token_ids=token_ids))
    return requests
