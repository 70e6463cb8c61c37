"""Answers the token budget cut short (finish_reason "length"), as OpenAI returns them: a forced tool call cut
mid-arguments is still a call (its arguments as far as they got), and the reason stays "length"."""

from __future__ import annotations

import json

import pytest

from inflight.serve_app.responses import finish_reason
from inflight.serve_app.tools import NamedFunction, NamedToolChoice, Tool, forced_constraint, read_calls

TOOLS = [Tool.model_validate({"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    for name in ("get_weather", "get_time")]


def test_a_required_call_writes_its_name_before_its_arguments():
    spec = forced_constraint(TOOLS, "required", parallel=True)["spec"]
    from inflight.engine.structured_output import StructuredOutput

    normalized = json.loads(StructuredOutput("json", spec).spec)
    assert list(normalized["items"]["anyOf"][0]["properties"]) == ["name", "arguments"]


@pytest.mark.parametrize("text, expected", [
    ('[{"name": "get_weather", "arguments": {"ci', [("get_weather", '{"ci')]),
    ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"ci',
     [("get_weather", '{"city": "Paris"}'), ("get_time", '{"ci')]),
    ('[{"name": "get_time", "arguments": {"city": "Oslo"}}', [("get_time", '{"city": "Oslo"}')]),  # no "]" yet
    ('[{"name": "get_wea', []),  # no name written whole: no call
    ('[{"name":"get_time","arguments":{"city":"Oslo"}},{"name":"get_weather","arguments":',
     [("get_time", '{"city":"Oslo"}'), ("get_weather", "")]),
])
def test_a_required_call_cut_short_keeps_the_calls_it_named(text, expected):
    content, calls = read_calls(text, TOOLS, "required")
    assert content is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == expected


def test_a_whole_required_answer_reads_as_before():
    content, calls = read_calls('[{"name": "get_time", "arguments": {"city": "Oslo"}}]', TOOLS, "required")
    assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Oslo"}]


def test_the_finish_reason_says_length_when_the_budget_cut_a_call():
    named = NamedToolChoice(type="function", function=NamedFunction(name="get_time"))
    _, calls = read_calls('{"ci', TOOLS, named)
    assert finish_reason("length", calls) == "length"
    assert finish_reason("stop", calls) == "tool_calls"
    assert finish_reason("length", []) == "length" and finish_reason("stop", []) == "stop"
