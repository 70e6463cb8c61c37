"""``SamplingParams.output_kind``: cumulative, delta and final-only outputs carry the same request.

Delta outputs joined must equal the cumulative run's final output (tokens, text with stop strings held
back, logprobs), each must hold only what its step added, and the prompt's fields come once. Final-only
is one output per request. Both through the engine, the async engine (merging for a slow consumer) and
the engine in a process of its own (outputs pickled)."""

from __future__ import annotations

import asyncio
import collections

import pytest

from inflight.engine import AsyncLLMEngine, SamplingParams
from tests.engine.helpers import make_engine, random_prompts

PROMPTS = random_prompts(3, 6, 14, seed=11)


def outputs_by_request(engine, params_list, prompts=PROMPTS):
    """Every output of every request, in step order, by request id."""
    for i, (prompt, params) in enumerate(zip(prompts, params_list)):
        engine.add_request(f"r{i}", prompt, params)
    seen = collections.defaultdict(list)
    for _ in range(500):
        if not engine.has_unfinished_requests():
            return seen
        for output in engine.step():
            seen[output.request_id].append(output)
    raise AssertionError("engine did not finish")


def params_for(kind, stop=(), **extra):
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=24, logprobs=2, prompt_logprobs=1, n=2,
                          seed=3, stop=stop, output_kind=kind, **extra)


@pytest.fixture(scope="module")
def stop_string():
    """A piece of what request r0 generates, so that a stop string really ends it mid-way."""
    [out] = outputs_by_request(make_engine(), [params_for("cumulative")], PROMPTS[:1])["r0"][-1:]
    text = out.outputs[0].text
    assert len(text) > 12, "demo-tiny must produce enough text for this test"
    return text[8:10]


def test_delta_outputs_join_to_the_cumulative_final(stop_string):
    cumulative = outputs_by_request(make_engine(), [params_for("cumulative", stop=[stop_string])] * 3)
    delta = outputs_by_request(make_engine(), [params_for("delta", stop=[stop_string])] * 3)
    assert cumulative.keys() == delta.keys() == {"r0", "r1", "r2"}
    stopped = 0
    for request_id, outs in delta.items():
        final = cumulative[request_id][-1]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        for index in range(2):
            want = final.outputs[index]
            pieces = [o.outputs[index] for o in outs]
            assert [t for p in pieces for t in p.token_ids] == want.token_ids
            assert "".join(p.text for p in pieces) == want.text
            assert [e for p in pieces for e in p.logprobs] == want.logprobs
            assert all(p.token_ids == p.new_token_ids and p.text == p.new_text for p in pieces)
            assert all(len(p.token_ids) <= 1 for p in pieces), "a step adds one token per sequence"
            assert pieces[-1].finish_reason == want.finish_reason
            assert pieces[-1].cumulative_logprob == pytest.approx(want.cumulative_logprob)
            stopped += want.stop_reason == stop_string
        assert stop_string not in "".join(p.text for o in outs for p in o.outputs[:1])
        # the prompt's fields once, in the first output
        assert outs[0].prompt_token_ids == final.prompt_token_ids
        assert outs[0].prompt_logprobs == final.prompt_logprobs and len(final.prompt_logprobs) > 1
        assert all(o.prompt_token_ids is None and o.prompt_logprobs is None for o in outs[1:])
    assert stopped >= 1, "the stop string must have ended at least one sequence"


def test_final_only_is_one_cumulative_output_per_request():
    cumulative = outputs_by_request(make_engine(), [params_for("cumulative")] * 3)
    final_only = outputs_by_request(make_engine(), [params_for("final_only")] * 3)
    for request_id, outs in final_only.items():
        assert len(outs) == 1 and outs[0].finished
        want = cumulative[request_id][-1]
        assert [c.token_ids for c in outs[0].outputs] == [c.token_ids for c in want.outputs]
        assert [c.text for c in outs[0].outputs] == [c.text for c in want.outputs]
        assert outs[0].prompt_logprobs == want.prompt_logprobs


def test_kinds_mix_in_one_batch():
    """One prompt, three requests sharing every step, one of each kind: the same tokens reach each its way."""
    kinds = ["cumulative", "delta", "final_only"]
    outs = outputs_by_request(make_engine(), [params_for(kind) for kind in kinds], [PROMPTS[0]] * 3)
    cumulative, delta, final_only = outs["r0"], outs["r1"], outs["r2"]
    assert len(cumulative) == len(delta) > 1 and len(final_only) == 1
    for index in range(2):
        want = cumulative[-1].outputs[index].token_ids
        assert [t for o in delta for t in o.outputs[index].token_ids] == want
        assert final_only[0].outputs[index].token_ids == want


def test_llm_generate_stays_cumulative_whatever_kind_is_asked():
    from inflight.engine import LLM

    llm = LLM("demo-tiny", block_size=4, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)
    [want] = llm.generate([PROMPTS[0]], params_for("cumulative"))
    [got] = llm.generate([PROMPTS[0]], params_for("delta"))
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert len(got.outputs[0].token_ids) == 24


def test_bad_output_kind_is_named():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="deltas")


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
def test_async_delta_for_a_slow_consumer_loses_nothing(engine_process):
    """Outputs that pile up while the consumer is busy are merged; delta merging must join, not replace."""
    want = outputs_by_request(make_engine(), [params_for("cumulative")], PROMPTS[:1])["r0"][-1]

    async def main():
        if engine_process:
            aengine = AsyncLLMEngine("demo-tiny", engine_process=True, block_size=4, num_kv_blocks=256,
                                     max_num_seqs=8, max_num_batched_tokens=64)
        else:
            aengine = AsyncLLMEngine(engine=make_engine())
        try:
            steps = []
            aengine.step_observer = lambda seconds, rows: steps.append(rows)  # on the thread that reports
            outs = []
            async for out in aengine.generate(PROMPTS[0], params_for("delta")):
                outs.append(out)
                # Busy until the engine has done 4 more steps (however long they take), or all of them.
                seen = len(steps)
                while len(steps) < seen + 4 and aengine.stats()["num_running"]:
                    await asyncio.sleep(0.005)
            return outs
        finally:
            await asyncio.wait_for(aengine.shutdown(), 10)

    outs = asyncio.run(asyncio.wait_for(main(), 60))
    assert len(outs) < 24, "steps that arrived while the consumer slept must be merged"
    for index in range(2):
        pieces = [o.outputs[index] for o in outs]
        assert [t for p in pieces for t in p.token_ids] == want.outputs[index].token_ids
        assert "".join(p.text for p in pieces) == want.outputs[index].text
        assert [e for p in pieces for e in p.logprobs] == want.outputs[index].logprobs
    assert outs[0].prompt_token_ids == PROMPTS[0] and outs[0].prompt_logprobs == want.prompt_logprobs
