"""Tool calling over HTTP with the official ``openai`` client: ``tool_choice`` required and named are always
valid calls (structured outputs), streaming or not; ``auto`` reads the model's own call formats; a
conversation carrying tool calls and tool results goes through; bad tools are 400s."""

from __future__ import annotations

import json

import openai
import pytest
from jsonschema import Draft202012Validator

from inflight.serve_app.tools import Tool, read_calls
from tests.serving.helpers import MODEL, assert_error_body, assert_schema

pytestmark = pytest.mark.timeout(120, func_only=True)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                             "unit": {"enum": ["celsius", "fahrenheit"]},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


def assert_valid_calls(calls):
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        Draft202012Validator(SCHEMAS[call.function.name]).validate(json.loads(call.function.arguments))


def test_required_always_gives_valid_calls(oai):
    for seed in range(12):
        response = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                               temperature=1.0, max_tokens=256, seed=seed,
                                               parallel_tool_calls=seed % 2 == 0)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert_valid_calls(choice.message.tool_calls)
        if seed % 2:
            assert len(choice.message.tool_calls) == 1, "parallel_tool_calls=false: one call"


def test_a_named_function_is_the_call(oai, client):
    named = {"type": "function", "function": {"name": "get_time"}}
    response = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, temperature=1.0,
                                           tool_choice=named, max_tokens=128, seed=5)
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert_valid_calls([call])
    raw = client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "tools": TOOLS,
                                                    "tool_choice": named, "max_tokens": 128})
    assert_schema("CreateChatCompletionResponse", raw.json())


def test_streamed_required_calls(oai, client):
    stream = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         temperature=1.0, max_tokens=256, seed=3, stream=True)
    chunks = list(stream)
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert deltas and all(d.function.name in SCHEMAS for d in deltas)
    for d in deltas:
        Draft202012Validator(SCHEMAS[d.function.name]).validate(json.loads(d.function.arguments))
    raw = client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "tools": TOOLS,
                                                    "tool_choice": "required", "max_tokens": 256, "seed": 3,
                                                    "stream": True})
    events = [json.loads(line[6:]) for line in raw.text.splitlines() if line.startswith("data: {")]
    for event in events:
        assert_schema("CreateChatCompletionStreamResponse", event)


def test_auto_and_none_answer_in_text_and_a_tool_conversation_goes_through(oai):
    for choice in ("auto", "none"):
        response = oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                               max_tokens=16, seed=1)
        assert response.choices[0].message.tool_calls is None  # the random model writes no call format
        assert response.choices[0].finish_reason in ("stop", "length")
    conversation = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    response = oai.chat.completions.create(model=MODEL, messages=conversation, tools=TOOLS, max_tokens=8)
    assert response.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "no tool is named"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "type object"),
    ({"tools": TOOLS + TOOLS[:1]}, "unique"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "letters"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
], ids=["unknown-named", "parameters-not-object", "duplicate-names", "bad-name", "required-without-tools",
        "required-with-response-format"])
def test_bad_tools_are_400(client, body, words):
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **body})
    error = assert_error_body(response, 400, "invalid_request_error")
    assert words in error["message"], error


TOOL_MODELS = [Tool.model_validate(t) for t in TOOLS]


@pytest.mark.parametrize("text, content, names", [
    ('Let me check. <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>', "Let me check.",
     ["get_time"]),
    ('[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}, '
     '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius", "days": 2}}]', None,
     ["get_time", "get_weather"]),
    ('{"name": "get_time", "parameters": {"zone": "PST"}}', None, ["get_time"]),
    ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "PST"}}', None, ["get_time"]),
    ('{"name": "launch_rockets", "parameters": {}}', '{"name": "launch_rockets", "parameters": {}}', []),
    ("Just text.", "Just text.", []),
], ids=["hermes", "mistral", "llama3-json", "llama3-python-tag", "undeclared-function", "plain"])
def test_auto_reads_the_model_families_call_formats(text, content, names):
    got_content, calls = read_calls(text, TOOL_MODELS, "auto")
    assert got_content == content
    assert [c["function"]["name"] for c in calls] == names
    for call in calls:
        json.loads(call["function"]["arguments"])
