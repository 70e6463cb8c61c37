"""The engine's core and its front end (engine.output_processor): the core reports new token ids and ends
(``LLMEngine.core_step``'s records), the front end makes text, finds stop strings and shapes the outputs, here
in ``LLMEngine.step`` or in a server's process while the engine's own process computes on (``engine_process``).

A stop string found by the front end ends the request in the core: at once in ``LLMEngine.step``, between the
next steps across processes; nothing computed after it is ever shown, and its KV blocks go back."""

from __future__ import annotations

import asyncio
import time

from inflight.engine import AsyncLLMEngine
from inflight.engine.core_messages import SequenceUpdate
from tests.engine.helpers import ENGINE_DEFAULTS, greedy, make_engine, random_prompts, run_engine

PROMPTS = random_prompts(4, 6, 20, seed=21)
LONG = 120  # tokens a request would run to without its stop string
UNSTOPPED = 1500  # the same, where the stop string is found in another process than the engine's
ROOMY_KV_BLOCKS = 2048  # of 4 tokens: every request can run to UNSTOPPED without preempting another


def stop_strings() -> list[str]:
    """For each prompt, a stop string its greedy continuation reaches after a few tokens (two characters of its
    own text, from where its 6th token starts)."""
    engine = make_engine()
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, greedy(LONG))
    outputs = run_engine(engine)
    stops = []
    for i in range(len(PROMPTS)):
        completion = outputs[str(i)].outputs[0]
        start = len(engine.tokenizer.decode(completion.token_ids[:5]))
        stops.append(completion.text[start:start + 2])
        assert len(stops[-1]) == 2, "the test needs text: demo-tiny's greedy bytes should decode to some"
    return stops


def test_a_stop_string_ends_the_request_in_the_core_within_the_step():
    stops = stop_strings()
    engine = make_engine()
    for i, (prompt, stop) in enumerate(zip(PROMPTS, stops)):
        engine.add_request(str(i), prompt, greedy(LONG, stop=[stop]))
    ended_at = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                ended_at[output.request_id] = output
                # the core let it go in the same step: not running, not waiting, no blocks
                assert output.request_id not in {r.parent_id for r in engine.scheduler.running}
    assert sorted(ended_at) == [str(i) for i in range(len(PROMPTS))]
    for i, stop in enumerate(stops):
        completion = ended_at[str(i)].outputs[0]
        assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
        assert stop not in completion.text and len(completion.token_ids) < LONG
    assert engine.scheduler.kv_stats().num_blocks_used == 0
    assert engine.stats()["num_generated_tokens"] == sum(len(o.outputs[0].token_ids) for o in ended_at.values())


def test_a_stop_string_found_in_the_servers_process_stops_the_engines_process():
    """With the engine in a process of its own, the front end (here) finds the stop string and tells the engine,
    which ends the request: the client sees exactly what the engine in this process gives, the engine stops long
    before the request's token limit, and its blocks go back.

    How many tokens past the stop the engine computes depends on how soon this process's event loop gets a core
    (a step or two on an idle machine; 52 tokens once on a busy one): so the limit is far away (UNSTOPPED tokens,
    seconds of steps), and only running into it fails."""
    stops = stop_strings()
    engine = make_engine(num_kv_blocks=ROOMY_KV_BLOCKS)
    for i, (prompt, stop) in enumerate(zip(PROMPTS, stops)):
        engine.add_request(str(i), prompt, greedy(UNSTOPPED, stop=[stop]))
    want = run_engine(engine)

    async def body(aengine):
        async def one(i):
            last = None
            async for last in aengine.generate(PROMPTS[i], greedy(UNSTOPPED, stop=[stops[i]])):
                pass
            return last

        outputs = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the engine reports its idle state once the stops reached it
            stats = aengine.stats()
            if stats["num_running"] == 0 and stats["kv_blocks_used"] == 0:
                break
            await asyncio.sleep(0.05)
        return outputs, aengine.stats()

    async def main():
        aengine = AsyncLLMEngine("demo-tiny", engine_process=True, **{**ENGINE_DEFAULTS, "num_kv_blocks": ROOMY_KV_BLOCKS})
        try:
            return await asyncio.wait_for(body(aengine), 60)
        finally:
            await aengine.shutdown()

    outputs, stats = asyncio.run(main())
    for i, output in enumerate(outputs):
        got, expected = output.outputs[0], want[str(i)].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
            (expected.token_ids, expected.text, "stop", stops[i])
    assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0
    shown = sum(len(o.outputs[0].token_ids) for o in outputs)
    # every request ended by its stop string, well before its limit
    assert shown <= stats["num_generated_tokens"] < len(PROMPTS) * (UNSTOPPED - 100), stats["num_generated_tokens"]


def test_the_core_reports_a_final_only_request_once_unless_a_stop_string_may_end_it():
    engine = make_engine()
    engine.add_request("quiet", PROMPTS[0], greedy(9, output_kind="final_only"))
    engine.add_request("stops", PROMPTS[1], greedy(9, output_kind="final_only", stop=["\x00never"]))
    engine.add_request("delta", PROMPTS[2], greedy(9, output_kind="delta", logprobs=1, prompt_logprobs=1))
    records: dict[str, list[SequenceUpdate]] = {"quiet": [], "stops": [], "delta": []}
    parent_of = {child.request_id: parent for parent, children in engine._children.items() for child in children}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for record in engine.core_step():  # records name sequences (a request's n children), not requests
            assert isinstance(record, SequenceUpdate)  # (no plain steps: each request here has something else)
            records[parent_of[record.request_id]].append(record)
    quiet = records["quiet"]
    assert len(quiet) == 1 and len(quiet[0].new_token_ids) == 9 and quiet[0].finish_reason == "length"
    assert len(records["stops"]) == 9 and all(len(r.new_token_ids) == 1 for r in records["stops"])
    first, *rest = records["delta"]
    assert len(first.prompt_logprobs) == len(PROMPTS[2]) and first.prompt_logprobs[0] is None  # position 0: none
    assert first.metrics is not None and rest[-1].metrics is not None  # metrics in the first and last record
    assert all(r.prompt_logprobs is None for r in rest) and all(r.metrics is None for r in rest[:-1])
    assert [len(r.logprobs) for r in records["delta"]] == [1] * 9  # one raw logprob entry per new token
    assert engine.num_finished_requests == 3 and not engine.has_unfinished_requests()
