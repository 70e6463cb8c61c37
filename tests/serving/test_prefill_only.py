"""Prefill-only requests over real HTTP: ``/v1/embeddings`` and completions with ``echo`` (+ ``logprobs``,
``max_tokens: 0``), checked against the engine run in this process on the same demo-tiny weights."""

from __future__ import annotations

import base64
import struct

import pytest

from inflight.engine import LLM, PoolingParams, SamplingParams
from tests.serving.helpers import (COMPLETION_ECHO, MODEL, assert_error_body, assert_schema, completion_body,
                                   post_stream)

pytestmark = pytest.mark.timeout(60, func_only=True)

E = "/v1/embeddings"
PROMPT = "The quick brown fox"  # byte-level tokenizer: bos + 19 bytes = 20 tokens
NUM_PROMPT_TOKENS = len(PROMPT) + 1


@pytest.fixture(scope="module")
def engine_llm() -> LLM:
    """The engine alone, on the app's model: what the server must agree with."""
    return LLM(MODEL, num_kv_blocks=64, max_num_seqs=4)


def embedding_body(**overrides):
    return {"model": MODEL, "input": PROMPT, **overrides}


def assert_embeddings_shape(body: dict, num_inputs: int) -> None:
    """OpenAI's documented CreateEmbeddingResponse (the repo's OpenAPI subset has no embeddings schema)."""
    assert set(body) == {"object", "data", "model", "usage"}, body.keys()
    assert body["object"] == "list" and body["model"] == MODEL
    assert [d["index"] for d in body["data"]] == list(range(num_inputs))
    for item in body["data"]:
        assert set(item) == {"object", "index", "embedding"} and item["object"] == "embedding"
    usage = body["usage"]
    assert set(usage) == {"prompt_tokens", "total_tokens"} and usage["prompt_tokens"] == usage["total_tokens"] > 0


def test_embeddings_match_the_engine(client, engine_llm):
    inputs = [PROMPT, "a", "hello, world"]
    response = client.post(E, json=embedding_body(input=inputs, user="someone"))
    assert response.status_code == 200, response.text
    body = response.json()
    assert_embeddings_shape(body, 3)
    assert body["usage"]["prompt_tokens"] == sum(len(t) + 1 for t in inputs)
    want = [o.embedding for o in engine_llm.embed(inputs, PoolingParams())]
    for item, vector in zip(body["data"], want):
        assert len(item["embedding"]) == 128  # demo-tiny's hidden size
        assert item["embedding"] == pytest.approx(vector, abs=1e-5)


def test_embeddings_of_token_ids_and_as_base64(client, engine_llm):
    ids = [1, 72, 105, 33]
    response = client.post(E, json=embedding_body(input=[ids, ids[:2]]))
    assert response.status_code == 200, response.text
    floats = response.json()
    assert_embeddings_shape(floats, 2)
    assert floats["usage"]["prompt_tokens"] == 6
    response = client.post(E, json=embedding_body(input=ids, encoding_format="base64"))
    assert response.status_code == 200, response.text
    single = response.json()
    assert_embeddings_shape(single, 1)
    packed = base64.b64decode(single["data"][0]["embedding"])
    decoded = list(struct.unpack(f"<{len(packed) // 4}f", packed))
    # (alone in its lane batch here, with another prompt above: matmuls of other shapes round differently)
    assert decoded == pytest.approx(floats["data"][0]["embedding"], abs=1e-5)
    assert decoded == pytest.approx(engine_llm.embed(ids)[0].embedding, abs=1e-5)


BAD_EMBEDDINGS = [
    ("empty-string", embedding_body(input=""), "input"),
    ("empty-list", embedding_body(input=[]), "input"),
    ("empty-token-list", embedding_body(input=[[]]), "input"),
    ("one-empty-string-of-two", embedding_body(input=["a", ""]), "input"),
    ("mixed-types", embedding_body(input=["a", 1]), "input"),
    ("token-out-of-vocab", embedding_body(input=[1, 10 ** 6]), "input"),
    ("too-long", embedding_body(input=["a", "b" * 3000]), "input"),
    ("too-many-inputs", embedding_body(input=["a"] * 2049), "input"),
    ("dimensions", embedding_body(dimensions=8), "dimensions"),
    ("encoding-format", embedding_body(encoding_format="int8"), "encoding_format"),
    ("unknown-field", embedding_body(stream=True), "stream"),
    ("missing-input", {"model": MODEL}, "input"),
    ("timeout-negative", embedding_body(timeout=-1), "timeout"),
]


@pytest.mark.parametrize("body, param", [b[1:] for b in BAD_EMBEDDINGS], ids=[b[0] for b in BAD_EMBEDDINGS])
def test_bad_embeddings_request_is_400_and_the_server_goes_on(client, body, param):
    error = assert_error_body(client.post(E, json=body), 400, "invalid_request_error")
    assert error["param"] is not None and param in error["param"], error
    ok = client.post(E, json=embedding_body())
    assert ok.status_code == 200, f"server stopped serving after a bad request: {ok.text[:300]}"


def test_embeddings_unknown_model_is_404_and_bad_json_400(client):
    error = assert_error_body(client.post(E, json=embedding_body(model="gpt-17")), 404, "invalid_request_error")
    assert error["param"] == "model" and error["code"] == "model_not_found"
    assert_error_body(client.post(E, content=b'{"model": ', headers={"content-type": "application/json"}), 400)


def prompt_entries(llm: LLM, prompt: str, num_top: int):
    """The engine's prompt logprobs as (logprob, {top text: logprob}) per position after the first."""
    output = llm.generate(prompt, SamplingParams(max_tokens=0, prompt_logprobs=num_top))[0]
    return [(entry[token].logprob, {lp.decoded_token: lp.logprob for lp in entry.values() if lp.rank <= num_top})
            for entry, token in zip(output.prompt_logprobs[1:], output.prompt_token_ids[1:])]


def test_echo_with_max_tokens_0_scores_the_prompt(client, engine_llm):
    response = client.post("/v1/completions", json=completion_body(PROMPT, max_tokens=0, echo=True, logprobs=2))
    assert response.status_code == 200, response.text
    body = response.json()
    [choice] = body["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": NUM_PROMPT_TOKENS, "completion_tokens": 0,
                             "total_tokens": NUM_PROMPT_TOKENS}
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == NUM_PROMPT_TOKENS
    assert logprobs["tokens"][1:] == list(PROMPT)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    want = prompt_entries(engine_llm, PROMPT, 2)
    assert logprobs["token_logprobs"][1:] == pytest.approx([lp for lp, _ in want], abs=1e-5)
    for got, (_, top) in zip(logprobs["top_logprobs"][1:], want):
        assert got.keys() == top.keys() and list(got.values()) == pytest.approx(list(top.values()), abs=1e-5)
    assert_schema(COMPLETION_ECHO, body)


def test_echo_then_generation(client, engine_llm):
    body = completion_body(PROMPT, max_tokens=4, echo=True, logprobs=1, temperature=0, ignore_eos=True)
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    generated = engine_llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert choice["text"] == PROMPT + generated.outputs[0].text
    logprobs = choice["logprobs"]
    assert len(logprobs["token_logprobs"]) == NUM_PROMPT_TOKENS + 4
    assert logprobs["token_logprobs"][1:NUM_PROMPT_TOKENS] == pytest.approx(
        [lp for lp, _ in prompt_entries(engine_llm, PROMPT, 1)], abs=1e-5)
    assert response.json()["usage"]["completion_tokens"] == 4
    assert_schema(COMPLETION_ECHO, response.json())
    plain = client.post("/v1/completions", json={**body, "echo": False, "logprobs": None}).json()
    assert plain["choices"][0]["text"] == generated.outputs[0].text  # without echo: the completion alone
    assert_schema("CreateCompletionResponse", plain)


def test_streamed_echo(client):
    body = completion_body(PROMPT, max_tokens=3, echo=True, temperature=0, ignore_eos=True,
                           stream_options={"include_usage": True})
    response, stream = post_stream(client, "/v1/completions", body)
    assert response.status_code == 200 and stream.done and not stream.errors
    full = client.post("/v1/completions", json=body).json()
    assert stream.text() == full["choices"][0]["text"] and stream.text().startswith(PROMPT)
    assert stream.chunks[0]["choices"][0]["text"].startswith(PROMPT)  # the prompt comes first, whole
    assert stream.usage["completion_tokens"] == 3
    scored, scored_stream = post_stream(client, "/v1/completions", completion_body(PROMPT, max_tokens=0, echo=True))
    assert scored.status_code == 200 and scored_stream.text() == PROMPT
