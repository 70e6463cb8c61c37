"""AsyncLLMEngine: streaming, concurrency, cancellation, errors and a dead step loop. No pytest-asyncio:
each test runs its own event loop with asyncio.run and a timeout, so nothing can hang.

A test that counts a stream's outputs, or how far the engine ran before an abort, uses a ``LockstepEngine`` (the
engine never hands over a step's outputs before the consumer took the ones before): on a busy machine the event loop
can lag the engine by many steps, whose outputs would then arrive merged."""

from __future__ import annotations

import asyncio

import pytest

from inflight.engine import AsyncLLMEngine, EngineDeadError
from tests.engine.helpers import LockstepEngine, assert_engine_dead, generate_ids, greedy, make_engine, random_prompts

TIMEOUT_S = 30


def run(coro_fn, lockstep: bool = False, **engine_args):
    """Run ``coro_fn(async_engine)`` on a fresh event loop with a timeout; shut the engine down afterwards.
    ``lockstep``: a ``LockstepEngine``, whose consumers never fall behind."""
    async def main():
        aengine = (LockstepEngine if lockstep else AsyncLLMEngine)(engine=make_engine(**engine_args))
        try:
            return await asyncio.wait_for(coro_fn(aengine), TIMEOUT_S)
        finally:
            try:
                await asyncio.wait_for(aengine.shutdown(), 5)
            except (EngineDeadError, RuntimeError):
                pass  # a test killed the loop on purpose; shutting down after that is tested on its own

    return asyncio.run(main())


async def collect(aengine, prompt, params, **kwargs):
    return [out async for out in aengine.generate(prompt, params, **kwargs)]


async def wait_until(predicate, timeout_s=3.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def test_stream_concatenates_to_final_and_matches_sync():
    prompt = random_prompts(1, 12, 12, seed=1)[0]
    [want] = generate_ids(make_engine(), [prompt], greedy(10))

    async def body(aengine):
        return await collect(aengine, prompt, greedy(10))

    outs = run(body, lockstep=True)
    assert len(outs) >= 2, "outputs are streamed step by step"
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    final = outs[-1].outputs[0]
    assert final.token_ids == want
    assert [t for o in outs for t in o.outputs[0].new_token_ids] == want
    assert "".join(o.outputs[0].new_text for o in outs) == final.text
    assert final.finish_reason == "length"


def test_concurrent_generates_all_finish_with_sync_results():
    prompts = random_prompts(8, 2, 30, seed=2)
    max_tokens = [3, 8, 5, 1, 6, 2, 7, 4]
    want = generate_ids(make_engine(), prompts, [greedy(m) for m in max_tokens])

    async def body(aengine):
        results = await asyncio.gather(*(collect(aengine, p, greedy(m)) for p, m in zip(prompts, max_tokens)))
        return [r[-1] for r in results], aengine.stats()

    finals, stats = run(body, max_num_seqs=3, max_num_batched_tokens=16)
    assert all(f.finished for f in finals)
    assert [f.outputs[0].token_ids for f in finals] == want
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0


LONG = 900  # tokens: far more than can be generated before the blocks must be back (max_model_len is 1024)


def test_breaking_out_of_the_stream_aborts_and_frees_blocks():
    async def body(aengine):
        async for out in aengine.generate(list(range(7, 40)), greedy(LONG)):
            assert not out.finished
            assert aengine.stats()["kv_blocks_used"] > 0
            break
        freed = await wait_until(lambda: aengine.stats()["kv_blocks_used"] == 0)
        idle = await wait_until(lambda: not aengine.engine.has_unfinished_requests())
        generated = aengine.engine.num_generated_tokens
        # the engine still serves afterwards
        after = await collect(aengine, [10, 11], greedy(3))
        return freed, idle, generated, after

    freed, idle, generated, after = run(body, lockstep=True)  # the engine cannot run far past the break
    assert freed, "KV blocks were not freed after the consumer stopped iterating"
    assert idle and generated < LONG, "the request ran on instead of being aborted"
    assert after[-1].finished and len(after[-1].outputs[0].token_ids) == 3


def test_cancelling_the_task_aborts_and_frees_blocks():
    async def body(aengine):
        started = asyncio.Event()

        async def consume():
            async for _ in aengine.generate(list(range(7, 40)), greedy(LONG)):
                started.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        freed = await wait_until(lambda: aengine.stats()["kv_blocks_used"] == 0 and
                                 not aengine.engine.has_unfinished_requests())
        return freed, aengine.engine.num_generated_tokens

    freed, generated = run(body, lockstep=True)  # the engine cannot run far past the cancel
    assert freed, "KV blocks were not freed after the task was cancelled"
    assert generated < LONG, "the request ran on instead of being aborted"


def test_bad_prompt_raises_value_error_and_others_are_unaffected():
    async def body(aengine):
        good = asyncio.create_task(collect(aengine, [10, 11, 12], greedy(6)))
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(aengine, list(range(7, 7 + 64)), greedy(2))  # longer than max_model_len
        with pytest.raises(ValueError, match="already in use"):
            await asyncio.gather(collect(aengine, [10], greedy(3), request_id="same"),
                                 collect(aengine, [11], greedy(3), request_id="same"))
        outs = await good
        aengine.check_health()
        return outs

    outs = run(body, max_model_len=64)
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6


def test_prompt_too_big_for_the_kv_pool_raises_value_error_not_engine_dead():
    """The engine is fine: the caller must get a ValueError about the request, not EngineDeadError."""
    async def body(aengine):
        with pytest.raises(ValueError, match="num_kv_blocks"):
            await collect(aengine, list(range(7, 7 + 40)), greedy(2))  # 40 tokens > 8 blocks of 4
        aengine.check_health()
        return await collect(aengine, [10, 11], greedy(2))

    outs = run(body, num_kv_blocks=8)
    assert outs[-1].finished


def test_dead_step_loop_fails_health_check_and_in_flight_requests(monkeypatch):
    async def body(aengine):
        aengine.check_health()  # healthy before the loop even starts
        stream = aengine.generate(list(range(7, 20)), greedy(LONG))
        first = await stream.__anext__()
        assert not first.finished
        aengine.check_health()  # healthy while running

        def broken_step():
            raise RuntimeError("injected fault")

        monkeypatch.setattr(aengine.engine, "core_step", broken_step)
        await assert_engine_dead(aengine, stream)
        return True

    assert run(body, lockstep=True)  # the request cannot end before the fault is in


def test_shutdown_after_the_step_loop_died_does_not_raise(monkeypatch):
    async def body():
        aengine = AsyncLLMEngine(engine=make_engine())

        def broken_step():
            raise RuntimeError("injected fault")

        monkeypatch.setattr(aengine.engine, "core_step", broken_step)
        with pytest.raises(EngineDeadError):
            await collect(aengine, [10, 11], greedy(2))
        await aengine.shutdown()

    asyncio.run(asyncio.wait_for(body(), TIMEOUT_S))


def test_a_slow_consumer_gets_merged_outputs_that_lose_nothing():
    """One message per read, not per token: steps pile up while the consumer is busy and arrive merged."""
    prompt = random_prompts(1, 8, 8, seed=2)[0]
    [want] = generate_ids(make_engine(), [prompt], greedy(40))

    async def body(aengine):
        steps = []
        aengine.step_observer = lambda seconds, rows: steps.append(rows)  # on the thread that reports
        outs = []
        async for out in aengine.generate(prompt, greedy(40)):
            outs.append(out)
            # Busy until the engine has done 5 more steps (however long they take), or all of them.
            seen = len(steps)
            assert await wait_until(lambda: len(steps) >= seen + 5 or aengine.stats()["num_running"] == 0, TIMEOUT_S)
        return outs

    outs = run(body)
    assert len(outs) < 40, "steps that arrived while the consumer slept must be merged"
    assert [t for o in outs for t in o.outputs[0].new_token_ids] == want
    assert "".join(o.outputs[0].new_text for o in outs) == outs[-1].outputs[0].text
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == want


def test_submit_validates_at_once_and_returns_the_prompt_ids():
    async def body(aengine):
        with pytest.raises(ValueError, match="max_model_len"):
            aengine.submit(list(range(7, 7 + 64)), greedy(2))  # longer than max_model_len: raised by submit itself
        stream = aengine.submit([10, 11, 12], greedy(3))
        assert stream.prompt_token_ids == [10, 11, 12]
        return [out async for out in stream]

    outs = run(body, max_model_len=64)
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3


def _paced(coro_fn, max_outputs_per_s: float, **engine_args):
    async def main():  # lockstep: the outputs a stream gets are those the pacing made, not merged by a lagging loop
        aengine = LockstepEngine(engine=make_engine(**engine_args), max_outputs_per_s=max_outputs_per_s)
        try:
            return await asyncio.wait_for(coro_fn(aengine), TIMEOUT_S)
        finally:
            await asyncio.wait_for(aengine.shutdown(), 5)

    return asyncio.run(main())


def test_paced_streams_get_their_first_output_at_once_then_everything_with_their_last():
    """``max_outputs_per_s``: an interval of (streams / budget) seconds after each output that shows something;
    with 1,000 s nothing comes between a stream's first text and its end, and no token is lost on the way."""
    prompts = random_prompts(4, 6, 20, seed=5)
    want = generate_ids(make_engine(), prompts, greedy(24))

    async def body(aengine):
        return await asyncio.gather(*(collect(aengine, p, greedy(24)) for p in prompts))

    results = _paced(body, max_outputs_per_s=4e-3)  # 4 streams: an interval of 1,000 s
    for outs, ids in zip(results, want):
        shown = [i for i, o in enumerate(outs) if o.outputs[0].new_text]
        assert shown and shown[0] < len(outs) - 1, "the first text goes when it comes, not with the last output"
        assert len(outs) == shown[0] + 2, "after the first text, only the last output (it carries the rest)"
        assert [t for o in outs for t in o.outputs[0].new_token_ids] == ids
        assert "".join(o.outputs[0].new_text for o in outs) == outs[-1].outputs[0].text
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]


def test_streams_waiting_for_a_slot_take_no_share_of_the_budget(monkeypatch):
    """One batch slot, three streams: each runs alone in turn, so each gets the whole budget while it runs. The
    clock moves 0.6 s a step: at 1 output a second, the output after one that showed text comes 2 steps (1.2 s)
    later, not 5 (3 s), which dividing the budget by the three open streams gave."""
    from tests.engine.helpers import hand_clock

    clock = hand_clock(monkeypatch)
    engine = make_engine(max_num_seqs=1)
    core_step = engine.core_step

    def step_and_tick():
        clock.advance(0.6)
        return core_step()

    engine.core_step = step_and_tick
    prompts = random_prompts(3, 6, 20, seed=8)

    async def timed(aengine, prompt):
        return [(clock.now, out) async for out in aengine.generate(prompt, greedy(16))]

    async def main():
        aengine = LockstepEngine(engine=engine, max_outputs_per_s=1.0)
        try:
            return await asyncio.wait_for(asyncio.gather(*(timed(aengine, p) for p in prompts)), TIMEOUT_S)
        finally:
            await asyncio.wait_for(aengine.shutdown(), 5)

    for outs in asyncio.run(main()):
        gaps = [later - at for (at, shown), (later, nxt) in zip(outs, outs[1:])
                if shown.outputs[0].new_text and not nxt.finished]
        assert len(gaps) >= 3 and all(abs(gap - 1.2) < 1e-6 for gap in gaps), gaps
        assert [t for _, o in outs for t in o.outputs[0].new_token_ids] == outs[-1][1].outputs[0].token_ids


def test_unpaced_streams_get_an_output_per_step_and_a_bad_budget_is_refused():
    prompt = random_prompts(1, 8, 8, seed=6)[0]
    outs = _paced(lambda aengine: collect(aengine, prompt, greedy(12)), max_outputs_per_s=1e9)
    assert len(outs) >= 6, "an interval of nanoseconds holds nothing back"
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="max_outputs_per_s"):
            AsyncLLMEngine(engine=make_engine(), max_outputs_per_s=bad)
