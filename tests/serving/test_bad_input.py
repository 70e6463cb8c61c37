"""Bad requests get 400 (404 for an unknown model) with OpenAI's error body, never 422 or 5xx, and the server
goes on serving."""

from __future__ import annotations

import json

import pytest

from tests.serving.helpers import MODEL, assert_error_body, wait_idle

pytestmark = pytest.mark.timeout(60, func_only=True)

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


def comp(**kw):
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **kw}


def chat(**kw):
    return {"model": MODEL, "messages": MSGS, "max_tokens": 4, **kw}


def without(body, key):
    return {k: v for k, v in body.items() if k != key}


# (id, path, body: dict or raw bytes, expected param or None when not checked)
BAD_REQUESTS = [
    ("malformed-json", C, b'{"model": "demo-tiny", "prompt": ', None),
    ("malformed-json-chat", CHAT, b'{"model": "demo-tiny", "messages": [', None),
    ("empty-body", C, b"", None),
    ("invalid-utf8", C, b'{"model": "demo-tiny", "prompt": "\xff\xfe"}', None),
    ("body-is-array", C, b"[1, 2, 3]", None),
    ("body-is-string", CHAT, b'"hello"', None),
    ("body-is-null", C, b"null", None),
    ("deeply-nested-json", C, b'{"model": "demo-tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    ("max-tokens-string", C, comp(max_tokens="abc"), "max_tokens"),
    ("temperature-string", C, comp(temperature="hot"), "temperature"),
    ("temperature-string-chat", CHAT, chat(temperature="hot"), "temperature"),
    ("temperature-5", C, comp(temperature=5), "temperature"),
    ("temperature-negative-chat", CHAT, chat(temperature=-0.5), "temperature"),
    ("temperature-nan", C, b'{"model": "demo-tiny", "prompt": "x", "temperature": NaN}', "temperature"),
    ("top-p-0", C, comp(top_p=0), "top_p"),
    ("top-p-1.5-chat", CHAT, chat(top_p=1.5), "top_p"),
    ("n-0", C, comp(n=0), "n"),
    ("n-too-many", CHAT, chat(n=1000), "n"),
    ("max-tokens-0", C, comp(max_tokens=0), "max_tokens"),
    ("max-tokens-minus-1", C, comp(max_tokens=-1), "max_tokens"),
    ("max-tokens-0-chat", CHAT, chat(max_tokens=0), "max_tokens"),
    ("max-completion-tokens-0-chat", CHAT, chat(max_completion_tokens=0), "max_completion_tokens"),
    ("logprobs-50", C, comp(logprobs=50), "logprobs"),
    ("top-logprobs-50-chat", CHAT, chat(logprobs=True, top_logprobs=50), "top_logprobs"),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), None),
    ("min-tokens-over-max-tokens", C, comp(min_tokens=10, max_tokens=5), "min_tokens"),
    ("stop-token-ids-negative", C, comp(stop_token_ids=[-1]), "stop_token_ids"),
    ("empty-stop-string", C, comp(stop=[""]), "stop"),
    ("timeout-negative", C, comp(timeout=-1), "timeout"),
    ("seed-not-int", C, comp(seed="abc"), "seed"),
    ("seed-too-large", C, comp(seed=2 ** 64, temperature=1.0), "seed"),
    ("missing-prompt", C, without(comp(), "prompt"), "prompt"),
    ("empty-prompt", C, comp(prompt=""), "prompt"),
    ("prompt-wrong-type", C, comp(prompt={"text": "hi"}), "prompt"),
    ("prompt-token-id-out-of-vocab", C, comp(prompt=[1, 10 ** 6]), None),
    ("prompt-token-id-negative", C, comp(prompt=[1, -5]), None),
    ("missing-messages", CHAT, without(chat(), "messages"), "messages"),
    ("empty-messages", CHAT, chat(messages=[]), "messages"),
    ("message-bad-role", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), None),
    ("message-image-part", CHAT, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), "messages"),
    ("missing-model", C, without(comp(), "model"), "model"),
    ("missing-model-chat", CHAT, without(chat(), "model"), "model"),
    ("unknown-field", C, comp(frobnicate=True), "frobnicate"),
    ("unknown-field-chat", CHAT, chat(frobnicate=True), "frobnicate"),
    ("prompt-plus-max-tokens-over-max-model-len", C, comp(prompt="a" * 1000, max_tokens=1500), None),
    ("prompt-over-max-model-len", C, comp(prompt="a" * 3000), None),
    ("prompt-over-max-model-len-stream", C, comp(prompt="a" * 3000, stream=True), None),
    ("chat-over-max-model-len", CHAT, chat(messages=[{"role": "user", "content": "a" * 3000}]), None),
    ("chat-plus-max-tokens-over-max-model-len", CHAT,
     chat(messages=[{"role": "user", "content": "a" * 1000}], max_tokens=1500), None),
    ("tools-of-another-type", CHAT, chat(tools=[{"type": "custom", "custom": {"name": "f"}}]), None),
    ("response-format-yaml", CHAT, chat(response_format={"type": "yaml"}), None),
    ("echo-max-tokens-0-n2", C, comp(echo=True, max_tokens=0, n=2), "n"),
    ("echo-max-tokens-0-chat", CHAT, chat(echo=True, max_tokens=0), None),
    ("suffix", C, comp(suffix="tail"), None),
    ("best-of", C, comp(best_of=3), None),
    ("logit-bias-over-100", C, comp(logit_bias={"5": 101}), "logit_bias"),
    ("logit-bias-not-a-token-id", C, comp(logit_bias={"five": 1}), "logit_bias"),
    ("logit-bias-unicode-digit", C, comp(logit_bias={"\u00b2": 1}), "logit_bias"),
    ("logit-bias-outside-the-vocabulary", C, comp(logit_bias={"100000": 1}), "logit_bias"),
    ("logit-bias-outside-the-vocabulary-stream", CHAT, chat(logit_bias={"100000": 1}, stream=True), "logit_bias"),
    ("logit-bias-301-entries", C, comp(logit_bias={str(i): 1 for i in range(301)}), "logit_bias"),
    ("presence-penalty-over-2", CHAT, chat(presence_penalty=2.5), "presence_penalty"),
    ("frequency-penalty-string", C, comp(frequency_penalty="a lot"), "frequency_penalty"),
    ("repetition-penalty-0", C, comp(repetition_penalty=0), "repetition_penalty"),
    ("stream-several-prompts", C, comp(prompt=["a", "b"], stream=True), "prompt"),
]


def normal_request_ok(client) -> None:
    response = client.post(C, json=comp(max_tokens=3, ignore_eos=True))
    assert response.status_code == 200, f"server stopped serving after a bad request: {response.text[:500]}"
    assert response.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("path, body, param", [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_is_400(client, path, body, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"content": json.dumps(body).encode()}
    response = client.post(path, headers={"content-type": "application/json"}, **kwargs)
    assert response.status_code not in (422,) and response.status_code < 500, \
        f"bad input must be a 400, got {response.status_code}: {response.text[:500]}"
    error = assert_error_body(response, 400, "invalid_request_error")
    if param is not None:
        assert error["param"] is not None and param in error["param"], error
    normal_request_ok(client)


@pytest.mark.parametrize("path, body", [(C, comp(model="gpt-17")), (CHAT, chat(model="gpt-17")),
                                        (C, comp(model="gpt-17", stream=True)), (CHAT, chat(model="", stream=True))],
                         ids=["completions", "chat", "completions-stream", "chat-stream-empty-name"])
def test_unknown_model_is_404(client, path, body):
    error = assert_error_body(client.post(path, json=body), 404, "invalid_request_error")
    assert error["param"] == "model" and error["code"] == "model_not_found", error
    normal_request_ok(client)


@pytest.mark.parametrize("prompt_chars, max_tokens, completion_tokens", [
    (2039, 8, 8),      # 1 + 2039 prompt tokens + 8 = 2048 exactly
    (2046, None, 1),   # no max_tokens: whatever room is left (one token)
], ids=["prompt-plus-max-tokens-exactly-max-model-len", "no-max-tokens-fills-the-context"])
def test_requests_at_the_context_limit_are_accepted(client, prompt_chars, max_tokens, completion_tokens):
    """The byte-level demo tokenizer: a prompt of N ASCII characters is N + 1 tokens (with BOS)."""
    response = client.post(C, json=comp(prompt="a" * prompt_chars, max_tokens=max_tokens, ignore_eos=True))
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] == prompt_chars + 1 and usage["completion_tokens"] == completion_tokens
    assert usage["total_tokens"] == 2048


def test_one_bad_prompt_among_several_stops_them_all(client, server):
    """A completions request with several prompts is refused as a whole when one is invalid; the valid
    prompts must not keep generating in the background, outside admission control."""
    response = client.post(C, json=comp(prompt=["a short prompt", "a" * 3000], max_tokens=1000, ignore_eos=True))
    assert_error_body(response, 400, "invalid_request_error")
    wait_idle(server, timeout=3.0)  # 1000 tokens take ~4 s: still running after 3 s means it was orphaned


def test_bad_requests_leave_no_trace(client, server):
    """Requests refused by the replica (after admission) give their admission slot back: more of them than
    ``max_pending_requests`` (48) in a row are all 400s, never 429s, and nothing stays queued or holds KV."""
    too_long = comp(prompt="a" * 3000)
    over_budget = comp(prompt="a" * 1000, max_tokens=1500)
    statuses = [client.post(C, json=too_long if i % 2 else over_budget).status_code for i in range(60)]
    assert statuses == [400] * 60, statuses
    stats = wait_idle(server, timeout=5.0)
    assert stats["router"]["in_flight"] == 0
    normal_request_ok(client)
