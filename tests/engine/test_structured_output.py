"""Structured outputs with xgrammar: what the engine generates under a JSON schema, any JSON object, a regex, a
choice and a grammar, on the random-weight demo model at temperature 1 (so only the constraint makes the text
valid); in both loops, under preemption, with n > 1; bad constraints are ValueErrors naming the parameter."""

from __future__ import annotations

import json
import re

import pytest
from jsonschema import Draft202012Validator

from inflight.engine import LLM, SamplingParams, StructuredOutput
from tests.engine.helpers import make_engine, random_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
PROMPTS = random_prompts(8, 4, 20, seed=31)


def constrained(kind, spec=None, seed=0, max_tokens=256, **kw):
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_output=StructuredOutput(kind, spec), **kw)


@pytest.fixture(scope="module")
def llm():
    return LLM("demo-tiny", block_size=4, num_kv_blocks=4096, max_num_seqs=64, max_num_batched_tokens=512)


def test_json_schema_outputs_parse_and_validate(llm):
    outputs = llm.generate([PROMPTS[i % 8] for i in range(50)], [constrained("json", SCHEMA, seed=i) for i in range(50)])
    stopped = [o.outputs[0] for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert len(stopped) >= 45, [o.outputs[0].finish_reason for o in outputs]
    validator = Draft202012Validator(SCHEMA)
    for completion in stopped:
        validator.validate(json.loads(completion.text))  # strict JSON: no raw control characters either


def test_json_object_regex_choice_and_grammar(llm):
    kinds = [("json_object", None), ("regex", r"[a-c]{3}-[0-9]{2}"), ("choice", ["yes", "no", "maybe so"]),
             ("grammar", 'root ::= "(" inner ")"\ninner ::= "x" inner | "y"')]
    for seed in range(5):
        outs = llm.generate(PROMPTS[:4], [constrained(kind, spec, seed=seed, max_tokens=64) for kind, spec in kinds])
        texts = [o.outputs[0].text for o in outs]
        if outs[0].outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(texts[0]), dict)
        assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", texts[1]) and outs[1].outputs[0].finish_reason == "stop"
        assert texts[2] in ("yes", "no", "maybe so")
        assert re.fullmatch(r"\(x*y\)", texts[3]) or outs[3].outputs[0].finish_reason == "length"


def test_a_schema_given_as_text_is_the_same_constraint():
    assert StructuredOutput("json", json.dumps(SCHEMA)) == StructuredOutput("json", SCHEMA)


def run(engine, params_list):
    for i, params in enumerate(params_list):
        engine.add_request(f"r{i}", PROMPTS[i % 8], params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = [c.text for c in out.outputs]
    return [final[f"r{i}"] for i in range(len(params_list))]


def test_the_same_constrained_samples_in_both_loops_under_preemption_with_n2():
    params = [constrained("json", SCHEMA, seed=i, max_tokens=80, n=2) for i in range(6)]
    roomy = run(make_engine(num_kv_blocks=512, max_num_seqs=16), params)
    tight_sync = make_engine(num_kv_blocks=70, max_num_seqs=12, preemption_mode="recompute")
    tight_async = make_engine(num_kv_blocks=70, max_num_seqs=12, preemption_mode="recompute", async_scheduling=True)
    assert run(tight_sync, params) == roomy
    assert run(tight_async, params) == roomy
    assert tight_sync.scheduler.preemption.num_preemptions > 0 and tight_async.scheduler.preemption.num_preemptions > 0
    for engine in (tight_sync, tight_async):
        assert len(engine.runner.sampler.constraints) == 0, "finished requests' matchers are dropped"


@pytest.mark.parametrize("kind, spec, words", [
    ("json", {"type": "nonsense"}, "json"),
    ("json", "{not json", "not JSON"),
    ("regex", "[a-", "regex"),
    ("grammar", 'root ::= "a" | ', "grammar"),
    ("choice", [], "choice"),
    ("choice", ["ok", ""], "choice"),
    ("xml", "<a/>", "kind"),
])
def test_bad_constraints_are_named_and_leave_the_engine_serving(kind, spec, words):
    engine = make_engine()
    with pytest.raises(ValueError, match="structured_outputs") as caught:
        engine.add_request("bad", PROMPTS[0], constrained(kind, spec, max_tokens=8))
    assert words in str(caught.value)
    assert not engine.has_unfinished_requests()
    assert run(engine, [constrained("regex", "[0-9]{4}", max_tokens=8)])[0][0].isdigit()


def test_structured_output_needs_tokens_to_generate():
    with pytest.raises(ValueError, match="structured_output"):
        SamplingParams(max_tokens=0, prompt_logprobs=0, structured_output=StructuredOutput("json_object"))


def test_a_grammar_compiles_off_the_step_loop_and_an_abort_meanwhile_ends_the_request():
    """While a constraint compiles (held here on an event) the engine goes on stepping other requests; the
    constrained request joins when its grammar is ready. One aborted while compiling ends as aborted."""
    import threading

    engine = make_engine()
    release = threading.Event()
    compile_for_real = engine.runner.sampler.constraints.compile

    def slow_compile(constraint):
        release.wait(10)
        return compile_for_real(constraint)

    engine.runner.sampler.constraints.compile = slow_compile
    # as when a server checked the constraint in its own process: here the engine compiles it for the first time
    engine.request_maker.check_structured_output = lambda constraint: None
    engine.add_request("constrained", PROMPTS[0], constrained("regex", "[0-9]{6}", max_tokens=8))
    engine.add_request("dropped", PROMPTS[1], constrained("regex", "[a-z]{6}", max_tokens=8))
    engine.add_request("plain", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    finished = {}
    for _ in range(40):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
        if "plain" in finished:
            break
    assert "plain" in finished and "constrained" not in finished, "the plain request must not wait for a compile"
    engine.abort_request("dropped")
    release.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
    assert finished["dropped"].finish_reason == "abort" and finished["dropped"].token_ids == []
    assert re.fullmatch("[0-9]{6}", finished["constrained"].text)
    assert engine.stats()["kv_blocks_used"] == 0


def test_a_compile_that_overruns_its_bound_is_a_value_error():
    import asyncio
    import threading

    from inflight.engine import AsyncLLMEngine

    async def main():
        aengine = AsyncLLMEngine(engine=make_engine())
        release = threading.Event()  # the compile ends only once the test is done, however long the bound waits
        aengine._maker.check_structured_output = lambda constraint: release.wait(30.0)
        try:
            with pytest.raises(ValueError, match="took longer than"):
                await aengine.check_structured_output(constrained("json_object"), timeout_s=0.05)
            await aengine.check_structured_output(SamplingParams(max_tokens=4), timeout_s=0.05)  # nothing to do
        finally:
            release.set()
            await aengine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 30))
