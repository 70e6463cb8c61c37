"""Streaming (SSE) format, usage accounting, streamed == non-streamed, determinism, and the official openai client."""

from __future__ import annotations

import pytest

from tests.serving.helpers import MODEL, chat_body, completion_body, post_stream

pytestmark = pytest.mark.timeout(60, func_only=True)


def test_sse_format_completions(client):
    # 200 tokens: a replica whose event loop is kept off the CPU while its engine runs gets what came meanwhile merged
    # into one message (on a busy machine a 20-token completion came whole, in 1 chunk, 2 times in 60).
    response, stream = post_stream(client, "/v1/completions", completion_body(max_tokens=200, ignore_eos=True))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    # parse_sse already checked every event is exactly `data: {...}\n\n` and [DONE] comes last, once.
    assert stream.raw.endswith("data: [DONE]\n\n")
    assert stream.done and not stream.errors
    assert len(stream.chunks) >= 2, "a 200-token completion should arrive in several chunks"
    ids = {c["id"] for c in stream.chunks}
    assert len(ids) == 1, ids
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in stream.chunks)
    assert stream.chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in stream.chunks[:-1])
    assert all("usage" not in c or c["usage"] is None for c in stream.chunks), "usage only when asked for"


def test_sse_format_chat(client):
    response, stream = post_stream(client, "/v1/chat/completions", chat_body(max_tokens=20, ignore_eos=True))
    assert response.status_code == 200 and stream.done and not stream.errors
    assert stream.chunks[0]["choices"][0]["delta"].get("role") == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in stream.chunks)
    assert len({c["id"] for c in stream.chunks}) == 1
    assert stream.chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path, make", [("/v1/completions", completion_body), ("/v1/chat/completions", chat_body)],
                         ids=["completions", "chat"])
def test_include_usage_final_chunk(client, path, make):
    max_tokens = 37
    body = make(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    _, stream = post_stream(client, path, {**body, "stream_options": {"include_usage": True}})
    assert stream.done and not stream.errors
    final = stream.chunks[-1]
    assert final["choices"] == [], final
    usage = final["usage"]
    assert usage["completion_tokens"] == max_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + max_tokens
    assert all(not c.get("usage") for c in stream.chunks[:-1]), "only the final chunk carries usage"
    plain = client.post(path, json=body).json()
    assert plain["usage"] == usage, "streamed and non-streamed usage differ for the same request"


def test_completion_tokens_counted_per_token(client):
    """With logprobs every streamed token is listed once: their count is max_tokens, as usage says."""
    _, stream = post_stream(client, "/v1/completions", completion_body(
        max_tokens=50, ignore_eos=True, logprobs=0, stream_options={"include_usage": True}))
    tokens = [t for c in stream.chunks for ch in c["choices"] for t in ch["logprobs"]["tokens"]]
    assert len(tokens) == 50 == stream.usage["completion_tokens"]


@pytest.mark.parametrize("path, make, chat", [("/v1/completions", completion_body, False),
                                              ("/v1/chat/completions", chat_body, True)], ids=["completions", "chat"])
def test_streamed_text_equals_non_streamed_greedy(client, path, make, chat):
    body = make("The quick brown fox", max_tokens=64, temperature=0, ignore_eos=True)
    plain = client.post(path, json=body).json()
    text = plain["choices"][0]["message"]["content"] if chat else plain["choices"][0]["text"]
    _, stream = post_stream(client, path, body)
    assert stream.done and not stream.errors
    assert stream.text(chat=chat) == text
    assert len(text) > 0


def test_greedy_is_repeatable(client):
    body = completion_body("Once upon a time", max_tokens=48, temperature=0, ignore_eos=True)
    texts = {client.post("/v1/completions", json=body).json()["choices"][0]["text"] for _ in range(3)}
    assert len(texts) == 1, texts


@pytest.mark.parametrize("path, chat", [("/v1/completions", False), ("/v1/chat/completions", True)],
                         ids=["completions", "chat"])
def test_seeded_sampling_repeatable_and_seed_dependent(client, path, chat):
    make = chat_body if chat else completion_body

    def text(seed):
        body = make("Tell me a story", max_tokens=40, temperature=1.0, seed=seed, ignore_eos=True)
        choice = client.post(path, json=body).json()["choices"][0]
        return choice["message"]["content"] if chat else choice["text"]

    first = text(1234)
    assert text(1234) == first, "same seed, same text"
    others = {text(seed) for seed in (1235, 99, 7)}
    assert first not in others, "a different seed should give a different 40-token sample"
    assert len(others) == 3


def test_seeded_stream_equals_seeded_non_stream(client):
    body = completion_body("Seeded", max_tokens=40, temperature=1.0, seed=42, ignore_eos=True, n=2)
    plain = client.post("/v1/completions", json=body).json()
    _, stream = post_stream(client, "/v1/completions", body)
    by_index = {c["index"]: c["text"] for c in plain["choices"]}
    assert stream.text(0) == by_index[0] and stream.text(1) == by_index[1]
    assert by_index[0] != by_index[1], "the n choices of one seeded request should differ"


def test_unseeded_sampling_varies(client):
    body = completion_body("Random", max_tokens=40, temperature=1.0, ignore_eos=True)
    texts = {client.post("/v1/completions", json=body).json()["choices"][0]["text"] for _ in range(3)}
    assert len(texts) > 1


def test_stop_string_ends_stream_without_it(client):
    """A stop string found in greedy output ends the completion there, with finish_reason stop, in both modes."""
    body = completion_body("abc", max_tokens=64, temperature=0, ignore_eos=True)
    full = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = next((full[i:i + 2] for i in range(4, len(full) - 2)
                 if all(32 < ord(ch) < 127 for ch in full[i:i + 2]) and full.find(full[i:i + 2]) == i), None)
    if stop is None:
        pytest.skip(f"no usable stop string in the greedy output {full!r}")
    expected = full[:full.index(stop)]
    stopped = client.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert stopped["text"] == expected and stopped["finish_reason"] == "stop"
    _, stream = post_stream(client, "/v1/completions", {**body, "stop": [stop]})
    assert stream.text() == expected and stream.chunks[-1]["choices"][0]["finish_reason"] == "stop"


# -- the official client ------------------------------------------------------------------------------------
@pytest.fixture
def openai_client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_openai_client_models(openai_client):
    assert [m.id for m in openai_client.models.list()] == [MODEL]


def test_openai_client_completions(openai_client):
    kwargs = {"model": MODEL, "prompt": "Hello there", "max_tokens": 24, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    result = openai_client.completions.create(**kwargs)
    assert result.object == "text_completion" and result.usage.completion_tokens == 24
    chunks = list(openai_client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == result.choices[0].text
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].choices == []


def test_openai_client_chat(openai_client):
    kwargs = {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Hi!"}],
              "max_tokens": 24, "temperature": 0, "extra_body": {"ignore_eos": True}}
    result = openai_client.chat.completions.create(**kwargs)
    assert result.choices[0].message.role == "assistant" and result.usage.completion_tokens == 24
    assert result.choices[0].finish_reason == "length"
    chunks = list(openai_client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == result.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_openai_client_seeded_chat_with_logprobs(openai_client):
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "Roll dice"}], "max_tokens": 16,
              "temperature": 1.0, "seed": 5, "logprobs": True, "top_logprobs": 3, "n": 2}
    a = openai_client.chat.completions.create(**kwargs)
    b = openai_client.chat.completions.create(**kwargs)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    for choice in a.choices:
        assert 1 <= len(choice.logprobs.content) <= 16
        assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
