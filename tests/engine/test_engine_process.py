"""AsyncLLMEngine with its step loop in a process of its own (engine_process=True, what servers use): the same
tokens as the engine in this process, errors where they were before, aborts, deadlines, and a dead process.

No pytest-asyncio: each test runs its own event loop with asyncio.run and a timeout, so nothing can hang."""

from __future__ import annotations

import asyncio
import os

import pytest

from inflight.engine import AsyncLLMEngine, DeadlineUnmeetableError, PoolingParams, SamplingParams
from tests.engine.helpers import (ENGINE_DEFAULTS, LockstepEngine, assert_engine_dead, greedy, make_engine,
                                  random_prompts, run_engine)

pytestmark = pytest.mark.slow  # each test starts an engine process (~2 s)

TIMEOUT_S = 60


def run(coro_fn, lockstep: bool = False, **engine_args):
    """``lockstep``: a ``LockstepEngine``, whose consumers never fall behind (each output is one step's)."""
    async def main():
        engine_cls = LockstepEngine if lockstep else AsyncLLMEngine
        aengine = engine_cls("demo-tiny", engine_process=True, **{**ENGINE_DEFAULTS, **engine_args})
        try:
            return await asyncio.wait_for(coro_fn(aengine), TIMEOUT_S)
        finally:
            await asyncio.wait_for(aengine.shutdown(), 15)

    return asyncio.run(main())


async def final(aengine, prompt, params, **kwargs):
    output = None
    async for output in aengine.generate(prompt, params, **kwargs):
        pass
    return output


def test_outputs_match_the_engine_in_this_process_token_for_token():
    prompts = random_prompts(6, 5, 40, seed=3)
    params = [greedy(12), greedy(12, logprobs=2), SamplingParams(max_tokens=12, temperature=1.0, seed=7),
              SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=11, n=2), greedy(5, stop=["a"]),
              greedy(12)]

    async def body(aengine):
        return await asyncio.gather(*[final(aengine, p, sp) for p, sp in zip(prompts, params)])

    got = run(body)
    engine = make_engine()
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, sp)
    expected = run_engine(engine)
    for i, output in enumerate(got):
        want = expected[f"r{i}"]
        assert output.finished
        assert [c.token_ids for c in output.outputs] == [c.token_ids for c in want.outputs]
        assert [c.text for c in output.outputs] == [c.text for c in want.outputs]
        assert [c.finish_reason for c in output.outputs] == [c.finish_reason for c in want.outputs]
    logprobs, want_logprobs = got[1].outputs[0].logprobs, expected["r1"].outputs[0].logprobs
    assert [sorted(e) for e in logprobs] == [sorted(e) for e in want_logprobs]
    assert [e[t].logprob for e, t in zip(logprobs, got[1].outputs[0].token_ids)] == pytest.approx(
        [e[t].logprob for e, t in zip(want_logprobs, got[1].outputs[0].token_ids)], abs=1e-5)


def test_embeddings_and_prompt_scoring_go_through_the_process():
    prompt = random_prompts(1, 20, 20, seed=4)[0]

    async def body(aengine):
        return await asyncio.gather(final(aengine, prompt, PoolingParams()),
                                    final(aengine, prompt, SamplingParams(max_tokens=0, prompt_logprobs=1)))

    embedded, scored = run(body)
    engine = make_engine()
    engine.add_request("e", prompt, PoolingParams())
    engine.add_request("s", prompt, SamplingParams(max_tokens=0, prompt_logprobs=1))
    expected = run_engine(engine)
    assert embedded.embedding == pytest.approx(expected["e"].embedding, abs=1e-5)
    assert len(scored.prompt_logprobs) == len(prompt) and scored.prompt_logprobs[0] is None


def test_a_bad_engine_argument_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="max_num_seqs"):
        AsyncLLMEngine("demo-tiny", engine_process=True, max_num_seqs=0)
    with pytest.raises(ValueError, match="engine object"):
        AsyncLLMEngine(engine=make_engine(), engine_process=True)


def test_a_bad_request_fails_at_submit_and_leaving_a_stream_frees_its_blocks():
    async def body(aengine):
        with pytest.raises(ValueError, match="max_model_len"):
            aengine.submit(list(range(7, 7 + 40)), greedy(2000))
        stream = aengine.generate(random_prompts(1, 30, 30, seed=5)[0], greedy(500))
        first = await stream.__anext__()
        assert not first.finished
        await stream.aclose()  # leaves early: the request is aborted in the engine's process
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while aengine.stats()["kv_blocks_used"] or aengine.stats()["num_running"]:
            assert loop.time() < deadline, aengine.stats()
            await asyncio.sleep(0.02)
        return await final(aengine, [10, 11, 12], greedy(3))

    # lockstep: the first output is the first step's, however far the engine's process got before it was read
    assert run(body, lockstep=True).outputs[0].finish_reason == "length"


def test_an_unmeetable_deadline_is_refused_from_the_process_view():
    async def body(aengine):
        for prompt in random_prompts(3, 20, 30, seed=1):
            await final(aengine, prompt, greedy(4))
        streams = [aengine.submit(p, greedy(8)) for p in random_prompts(12, 100, 120, seed=2)]
        with pytest.raises(DeadlineUnmeetableError) as refused:
            await final(aengine, random_prompts(1, 10, 10, seed=3)[0], greedy(4, timeout_s=0.001))
        outputs = [await final_of(stream) for stream in streams]
        return refused.value, outputs

    async def final_of(stream):
        output = None
        async for output in stream:
            pass
        return output

    error, outputs = run(body, max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=512)
    assert error.retry_after_s > 0
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)


def test_a_killed_engine_process_fails_its_requests_and_the_health_check():
    async def body():
        # The request must still run when the process is killed, right after its first output is read, even if this
        # process was kept off the CPU meanwhile: ~4,000 tokens take the engine's process seconds.
        aengine = AsyncLLMEngine("demo-tiny", engine_process=True, **{**ENGINE_DEFAULTS, "num_kv_blocks": 1024})
        try:
            aengine.check_health()
            stream = aengine.generate(random_prompts(1, 10, 10, seed=6)[0], greedy(4000))
            await stream.__anext__()
            aengine._core._process.kill()
            await assert_engine_dead(aengine, stream)
        finally:
            await aengine.shutdown()
        return aengine._core._process.poll()

    assert asyncio.run(asyncio.wait_for(body(), TIMEOUT_S)) is not None


def test_shutdown_ends_the_engine_process():
    async def body():
        aengine = AsyncLLMEngine("demo-tiny", engine_process=True, **ENGINE_DEFAULTS)
        assert not os.path.exists(aengine._core._socket_dir)  # the socket's directory goes once connected
        await final(aengine, [10, 11], greedy(2))
        await aengine.shutdown()
        return aengine._core._process.poll()

    assert asyncio.run(asyncio.wait_for(body(), TIMEOUT_S)) == 0


def test_the_engine_process_runs_on_its_cpus_and_a_missing_cpu_is_a_value_error():
    async def body():
        aengine = AsyncLLMEngine("demo-tiny", engine_process=True, engine_cpus="0", **ENGINE_DEFAULTS)
        try:
            output = await final(aengine, [10, 11], greedy(2))
            return output, os.sched_getaffinity(aengine._core._process.pid)
        finally:
            await aengine.shutdown()

    output, cpus = asyncio.run(asyncio.wait_for(body(), TIMEOUT_S))
    assert output.finished and cpus == {0}
    with pytest.raises(ValueError, match="engine_cpus"):
        AsyncLLMEngine("demo-tiny", engine_process=True, engine_cpus="4000", **ENGINE_DEFAULTS)
    with pytest.raises(ValueError, match="engine_process"):
        AsyncLLMEngine("demo-tiny", engine_cpus="0", **ENGINE_DEFAULTS)
