"""Responses against OpenAI's own OpenAPI description (tests/data/openai/openai-api-subset.json), via jsonschema."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.serving.helpers import (
    COMPLETION_STREAM_CHUNK,
    MODEL,
    assert_error_body,
    assert_schema,
    chat_body,
    completion_body,
    post_stream,
    schema_errors,
)

pytestmark = pytest.mark.timeout(60, func_only=True)


def test_schema_checker_rejects_wrong_shapes():
    """The checker itself can fail: wrong types, missing required fields, bad enums are caught."""
    good = {"id": "x", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "text": "a", "finish_reason": "length", "logprobs": None}]}
    assert schema_errors("CreateCompletionResponse", good) == []
    assert schema_errors("CreateCompletionResponse", {**good, "object": "completion"})
    assert schema_errors("CreateCompletionResponse", {**good, "choices": [{"index": 0, "text": "a"}]})
    assert schema_errors("CreateCompletionResponse", {**good, "usage": {"prompt_tokens": 1}})
    assert schema_errors("ErrorResponse", {"error": {"message": "m", "type": "t"}})  # param, code required
    assert schema_errors("CreateChatCompletionStreamResponse",
                         {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
                          "choices": [{"index": 0, "delta": {}, "finish_reason": "done"}]})
    # A stream chunk of a completion may carry finish_reason null, and nothing else is relaxed.
    chunk = {**good, "choices": [{"index": 0, "text": "a", "finish_reason": None, "logprobs": None}]}
    assert schema_errors("CreateCompletionResponse", chunk)
    assert schema_errors(COMPLETION_STREAM_CHUNK, chunk) == []
    assert schema_errors(COMPLETION_STREAM_CHUNK, {**chunk, "object": "chat.completion.chunk"})
    # `nullable: true` in the document is honoured (a stream chunk's finish_reason may be null).
    assert schema_errors("CreateChatCompletionStreamResponse",
                         {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
                          "choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]}) == []


def test_list_models(client):
    response = client.get("/v1/models")
    assert response.status_code == 200
    body = response.json()
    assert_schema("ListModelsResponse", body)
    assert [m["id"] for m in body["data"]] == [MODEL]


@pytest.mark.parametrize("extra", [{}, {"n": 2, "logprobs": 2}, {"n": 2, "logprobs": 0, "temperature": 0.8}],
                         ids=["plain", "n2-logprobs2", "n2-logprobs0-sampled"])
def test_completion_response(client, extra):
    response = client.post("/v1/completions", json=completion_body(max_tokens=12, ignore_eos=True, **extra))
    assert response.status_code == 200, response.text
    body = response.json()
    n = extra.get("n", 1)
    assert sorted(c["index"] for c in body["choices"]) == list(range(n))
    assert body["usage"]["completion_tokens"] == 12 * n
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 12 * n
    for choice in body["choices"]:
        assert choice["finish_reason"] == "length"
        if "logprobs" in extra:
            lp = choice["logprobs"]
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 12
            assert all(len(top) <= max(1, extra["logprobs"]) for top in lp["top_logprobs"])
        else:
            assert choice["logprobs"] is None
    assert_schema("CreateCompletionResponse", body)  # last: the checks above run even when this fails


def test_completion_several_prompts_with_n(client):
    """Several prompts x n choices: choice index = prompt index * n + choice number, as OpenAI numbers them."""
    response = client.post("/v1/completions", json=completion_body(prompt=["first", "second", "third!"], n=2,
                                                                   max_tokens=5, ignore_eos=True, temperature=0))
    assert response.status_code == 200, response.text
    body = response.json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert body["usage"]["completion_tokens"] == 30
    assert body["usage"]["prompt_tokens"] == (1 + 5) + (1 + 6) + (1 + 6)  # byte-level tokens + BOS
    texts = [c["text"] for c in body["choices"]]
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[4] == texts[5], texts  # greedy: n copies
    assert_schema("CreateCompletionResponse", body)


@pytest.mark.parametrize("extra", [{}, {"n": 2, "logprobs": True, "top_logprobs": 2}], ids=["plain", "n2-logprobs"])
def test_chat_response(client, extra):
    response = client.post("/v1/chat/completions", json=chat_body(max_tokens=10, ignore_eos=True, **extra))
    assert response.status_code == 200, response.text
    body = response.json()
    n = extra.get("n", 1)
    assert len(body["choices"]) == n
    assert body["usage"]["completion_tokens"] == 10 * n
    for choice in body["choices"]:
        assert choice["message"]["role"] == "assistant"
        if extra:
            assert len(choice["logprobs"]["content"]) == 10
            assert all(len(t["top_logprobs"]) == 2 for t in choice["logprobs"]["content"])
        else:
            assert choice["logprobs"] is None
    assert_schema("CreateChatCompletionResponse", body)


@pytest.mark.parametrize("extra", [{}, {"n": 2, "logprobs": 2}], ids=["plain", "n2-logprobs2"])
def test_completion_stream_chunks(client, extra):
    response, stream = post_stream(client, "/v1/completions", completion_body(
        max_tokens=10, ignore_eos=True, stream_options={"include_usage": True}, **extra))
    assert response.status_code == 200, stream.raw
    assert stream.done and not stream.errors, stream.raw[-500:]
    assert len(stream.chunks) >= 2
    # Only the chunks before a choice's end may lack a finish reason; its last chunk has one.
    last = {c["choices"][0]["index"]: c["choices"][0] for c in stream.chunks if c["choices"]}
    assert all(choice["finish_reason"] == "length" for choice in last.values()), last
    final = stream.chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 10 * extra.get("n", 1)
    if extra:
        tokens = Counter(ch["index"] for c in stream.chunks for ch in c["choices"] for _ in ch["logprobs"]["tokens"])
        assert tokens == {0: 10, 1: 10}, tokens
    failures = {}
    for i, chunk in enumerate(stream.chunks):  # every chunk, including the usage-only one
        errors = schema_errors(COMPLETION_STREAM_CHUNK, chunk)
        if errors:
            failures[i] = errors
    assert not failures, f"{len(failures)} of {len(stream.chunks)} chunks do not match CreateCompletionResponse: " \
                         f"{dict(list(failures.items())[:3])}"


@pytest.mark.parametrize("extra", [{}, {"n": 2, "logprobs": True, "top_logprobs": 2}], ids=["plain", "n2-logprobs"])
def test_chat_stream_chunks(client, extra):
    response, stream = post_stream(client, "/v1/chat/completions", chat_body(
        max_tokens=10, ignore_eos=True, stream_options={"include_usage": True}, **extra))
    assert response.status_code == 200, stream.raw
    assert stream.done and not stream.errors, stream.raw[-500:]
    final = stream.chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 10 * extra.get("n", 1)
    if extra:
        entries = [t for c in stream.chunks for ch in c["choices"] for t in (ch["logprobs"] or {}).get("content", [])]
        assert len(entries) == 10 * extra["n"] and all(len(t["top_logprobs"]) == 2 for t in entries)
    failures = {}
    for i, chunk in enumerate(stream.chunks):
        errors = schema_errors("CreateChatCompletionStreamResponse", chunk)
        if errors:
            failures[i] = errors
    assert not failures, f"{len(failures)} of {len(stream.chunks)} chunks do not match " \
                         f"CreateChatCompletionStreamResponse: {dict(list(failures.items())[:3])}"


@pytest.mark.parametrize("method, path, body, status", [
    ("POST", "/v1/completions", b"{not json", 400),
    ("POST", "/v1/chat/completions", b'{"model": "demo-tiny", "messages": []}', 400),
    ("POST", "/v1/completions", b'{"model": "gpt-17", "prompt": "x"}', 404),
    ("POST", "/v1/chat/completions", b'{"model": "gpt-17", "messages": [{"role": "user", "content": "x"}]}', 404),
], ids=["400-completions", "400-chat", "404-completions", "404-chat"])
def test_error_bodies(client, method, path, body, status):
    """4xx bodies are OpenAI ErrorResponses (429, 503 and 504 are checked where they are provoked)."""
    assert_error_body(client.request(method, path, content=body, headers={"content-type": "application/json"}), status)


@pytest.mark.parametrize("method, path, status", [
    ("POST", "/v1/no-such-endpoint", 404),
    ("GET", "/v1/completions", 405),
], ids=["unknown-route-404", "wrong-method-405"])
def test_framework_errors_use_openai_error_body(client, method, path, status):
    """Errors raised by the web framework itself (unknown route, wrong method) should be OpenAI-shaped too:
    an OpenAI client reads ``error.message`` from every non-2xx body."""
    response = client.request(method, path, json={})
    assert_error_body(response, status)


def test_openai_client_parses_errors(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-17", prompt="x", max_tokens=2)
    assert info.value.body["type"] == "invalid_request_error" and info.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=5)
    assert "temperature" in info.value.body["message"]
    assert info.value.status_code == 400
