"""Structured outputs over HTTP with the official ``openai`` client: OpenAI's response_format (json_schema,
json_object) on chat and completions, vLLM's structured_outputs and guided_* names, streaming; bad
constraints are 400s and the server goes on serving. The demo model has random weights and samples at
temperature 1: only the constraint makes its text valid."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from jsonschema import Draft202012Validator

from tests.serving.helpers import MODEL, assert_error_body

pytestmark = pytest.mark.timeout(120, func_only=True)

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 16},
        "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "horror"]}, "maxItems": 2},
        "director": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                       "born": {"type": "integer"}},
                     "required": ["name", "born"], "additionalProperties": False},
    },
    "required": ["title", "rating", "genres", "director"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "movie", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a movie as JSON."}]


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_json_schema_chat_completions_parse_and_validate(oai):
    def one(seed):
        return oai.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=RESPONSE_FORMAT,
                                           temperature=1.0, max_tokens=256, seed=seed)

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(one, range(50)))
    stopped = [r.choices[0] for r in responses if r.choices[0].finish_reason == "stop"]
    assert len(stopped) >= 45, [r.choices[0].finish_reason for r in responses]
    validator = Draft202012Validator(SCHEMA)
    for choice in stopped:
        validator.validate(json.loads(choice.message.content))


def test_json_object_always_parses_when_it_stops(oai):
    for seed in range(10):
        response = oai.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=1.0, max_tokens=128,
                                               seed=seed, response_format={"type": "json_object"})
        choice = response.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)


def test_streamed_json_schema_joins_to_valid_json(oai):
    stream = oai.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=RESPONSE_FORMAT,
                                         temperature=1.0, max_tokens=256, seed=7, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    Draft202012Validator(SCHEMA).validate(json.loads(text))


def test_completions_take_vllm_structured_outputs_and_guided_names(oai):
    regex = oai.completions.create(model=MODEL, prompt="Code:", max_tokens=32, temperature=1.0,
                                   extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", regex.choices[0].text)
    choice = oai.completions.create(model=MODEL, prompt="Answer:", max_tokens=8, temperature=1.0,
                                    extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    schema = oai.completions.create(model=MODEL, prompt="JSON:", max_tokens=256, temperature=1.0, seed=3,
                                    extra_body={"response_format": RESPONSE_FORMAT})  # as vLLM takes it on completions
    if schema.choices[0].finish_reason == "stop":
        Draft202012Validator(SCHEMA).validate(json.loads(schema.choices[0].text))


@pytest.mark.parametrize("extra, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "does not compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"structured_outputs": {"regex": "[a-"}}, "regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
    ({"guided_grammar": 'root ::= "a" | '}, "grammar"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "only one"),
], ids=["schema-does-not-compile", "json-schema-without-schema", "unknown-type", "bad-regex", "two-kinds",
        "bad-grammar", "two-sources"])
def test_bad_constraints_are_400_and_the_server_goes_on(client, extra, words):
    for stream in (False, True):
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "stream": stream, **extra}
        error = assert_error_body(client.post("/v1/chat/completions", json=body), 400, "invalid_request_error")
        assert words in error["message"], error
    ok = client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4})
    assert ok.status_code == 200, ok.text
