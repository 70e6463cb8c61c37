"""Deadline-aware admission: the engine predicts time to first token and refuses what it cannot meet."""

from __future__ import annotations

import asyncio
import threading

import pytest

from inflight.engine import AsyncLLMEngine, DeadlineUnmeetableError, SamplingParams
from inflight.engine.ttft_predictor import MIN_OBSERVATIONS, TTFTPredictor
from tests.engine.helpers import (
    ENGINE_DEFAULTS,
    greedy,
    hand_clock,
    make_engine,
    random_prompts,
    run_engine,
)


def busy_engine():
    """An engine that has run enough steps to trust its predictor, with a long queue of long prompts."""
    engine = make_engine(max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=512)
    for i, prompt in enumerate(random_prompts(3, 20, 30, seed=1)):
        engine.add_request(f"warm{i}", prompt, greedy(4))
    run_engine(engine)
    assert engine.predictor.ready
    for i, prompt in enumerate(random_prompts(12, 100, 120, seed=2)):
        engine.add_request(f"q{i}", prompt, greedy(8))
    return engine


def test_unmeetable_deadline_is_refused_at_once_and_disturbs_nothing():
    engine = busy_engine()
    with pytest.raises(DeadlineUnmeetableError) as refused:
        engine.add_request("hurry", random_prompts(1, 50, 50, seed=3)[0], greedy(4, timeout_s=0.001))
    assert refused.value.retry_after_s > 0 and refused.value.predicted_ttft_s > 0.001
    assert "hurry" not in engine.scheduler.requests
    engine.add_request("patient", random_prompts(1, 50, 50, seed=3)[0], greedy(4, timeout_s=600))
    finished = run_engine(engine)
    assert all(out.outputs[0].finish_reason == "length" for out in finished.values())
    assert set(finished) == {f"q{i}" for i in range(12)} | {"patient"}
    predicted = engine_predictions(finished)
    assert predicted and all(p > 0 for p in predicted)


def test_a_deadline_that_is_only_a_safety_net_is_not_refused_but_still_ends_the_request():
    """Servers mark their default timeout this way: the request is taken, and times out if it must."""
    engine = busy_engine()
    engine.add_request("net", random_prompts(1, 50, 50, seed=3)[0],
                       greedy(4, timeout_s=0.001, reject_unmeetable_deadline=False))
    finished = run_engine(engine)
    assert finished["net"].outputs[0].finish_reason == "timeout"


def engine_predictions(finished):
    return [out.metrics.predicted_ttft_s for out in finished.values() if out.metrics.predicted_ttft_s is not None]


def test_async_engine_refuses_through_the_stream(monkeypatch):
    # The engine's clock stands still: a prediction (~0.07 s here) takes off the time since its view was taken, and
    # on a busy machine the view can be older than that when the request comes.
    hand_clock(monkeypatch)

    async def body():
        engine = AsyncLLMEngine("demo-tiny", **{**ENGINE_DEFAULTS, "max_num_seqs": 2, "max_num_batched_tokens": 16})
        try:
            warm = [engine.generate(p, greedy(4)) for p in random_prompts(3, 20, 30, seed=1)]
            for stream in warm:
                async for _ in stream:
                    pass
            streams = [engine.submit(p, greedy(8)) for p in random_prompts(12, 100, 120, seed=2)]
            refused = engine.submit(random_prompts(1, 50, 50, seed=3)[0], SamplingParams(max_tokens=4, timeout_s=0.001))
            with pytest.raises(DeadlineUnmeetableError):
                async for _ in refused:
                    pass
            for stream in streams:
                async for _ in stream:
                    pass
        finally:
            await engine.shutdown()

    asyncio.run(body())


def test_async_engine_refuses_while_a_step_is_under_way(monkeypatch):
    """The refusal does not wait for the step under way (a long prefill step can outlast a short deadline):
    it is predicted from the step thread's latest view of the queue plus the requests submitted since."""
    # The engine's clock stands still: a prediction takes off the time since its view was taken, and on a busy
    # machine the time this test takes between that view and the hurried request would decide the refusal.
    hand_clock(monkeypatch)

    async def body():
        engine = AsyncLLMEngine("demo-tiny", **{**ENGINE_DEFAULTS, "max_num_seqs": 2, "max_num_batched_tokens": 16})
        try:
            for prompt in random_prompts(3, 20, 30, seed=1):
                async for _ in engine.generate(prompt, greedy(4)):
                    pass
            known_rates(engine.engine)
            async for _ in engine.generate(random_prompts(1, 5, 5, seed=4)[0], greedy(2)):  # a view with them
                pass
            real_step, inside, release, left = engine.engine.core_step, *(threading.Event() for _ in range(3))

            def held_step():  # until the test releases it: a refusal that waited for the step would never come
                inside.set()
                release.wait(60.0)
                left.set()
                return real_step()

            engine.engine.core_step = held_step
            first = engine.submit(random_prompts(1, 110, 110, seed=5)[0], greedy(4))
            assert await asyncio.get_running_loop().run_in_executor(None, inside.wait, 10.0)
            # Submitted while the step is held: not in the engine's queue yet, so only the pending list has them.
            streams = [first] + [engine.submit(p, greedy(4)) for p in random_prompts(12, 100, 120, seed=2)]
            hurried = engine.submit(random_prompts(1, 10, 10, seed=3)[0], greedy(4, timeout_s=0.3))
            with pytest.raises(DeadlineUnmeetableError) as refused:
                await asyncio.wait_for(_drain(hurried), 10.0)
            assert not left.is_set(), "refused only once the step under way had ended"
            assert "13 requests" in str(refused.value)  # the first one waits in the view, 12 were pending
            release.set()
            for stream in streams:
                async for output in stream:
                    pass
                assert output.outputs[0].finish_reason == "length"
        finally:
            release.set()
            await engine.shutdown()

    asyncio.run(body())


def test_remaining_work_of_requests_without_max_tokens_is_estimated_from_finished_ones():
    """A request with no max_tokens may run to max_model_len, but predicting that would refuse good requests:
    once a few have finished, at most twice their mean output length is assumed."""
    engine = make_engine(max_num_seqs=2, num_kv_blocks=512)
    for i, prompt in enumerate(random_prompts(6, 5, 10, seed=4)):
        engine.add_request(f"short{i}", prompt, greedy(6))
    run_engine(engine)
    engine.add_request("open-ended", random_prompts(1, 5, 5, seed=5)[0], SamplingParams(max_tokens=None,
                                                                                        temperature=0.0, ignore_eos=True))
    engine.step()
    (request,) = engine.scheduler.running
    assert request.max_total_tokens - request.num_tokens > 500  # its own bound: max_model_len
    assert engine._output_lengths.expected_remaining(request) == 2 * 6 - request.num_output_tokens


DECODE_S, PER_TOKEN_S = 0.003, 1e-4


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def known_rates(engine) -> None:
    """Replace the engine's measured rates with known ones, so its predictions can be checked exactly."""
    predictor = TTFTPredictor(engine.config.max_num_batched_tokens, engine.config.max_num_seqs)
    for tokens in [0, 64] + [0, 10] * MIN_OBSERVATIONS:
        predictor.observe(DECODE_S + PER_TOKEN_S * tokens, tokens)
    assert predictor.ready
    engine.predictor = predictor


def test_engine_predicts_from_its_queue_and_running_requests():
    """Two slots, both decoding (30 and 40 output tokens to go), then two requests queue: the first waits for
    the shorter remainder, the second for the longer one and behind the first's prompt."""
    engine = make_engine(max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=512)
    short, long = random_prompts(2, 10, 10, seed=6)
    engine.add_request("a", short, greedy(34))
    engine.add_request("b", long, greedy(43))
    for _ in range(4):
        engine.step()
    a, b = engine.scheduler.running
    assert (a.num_output_tokens, b.num_output_tokens) == (4, 3)  # b's prompt took the 6 tokens a left in step 1
    known_rates(engine)
    engine.add_request("c", random_prompts(1, 20, 20, seed=7)[0], greedy(4))
    engine.add_request("d", random_prompts(1, 12, 12, seed=8)[0], greedy(4))
    engine.add_request("e", random_prompts(1, 8, 8, seed=11)[0], greedy(4))
    c, d, e = engine.scheduler.waiting
    # c: a ends in 30 steps; its 20 tokens take 2 steps of 14 (16 minus 2 decodes).
    assert c.metrics.predicted_ttft_s == pytest.approx((30 + 2) * DECODE_S + 20 * PER_TOKEN_S)
    # d: b ends in 40 steps (c's 20 tokens are prefilled meanwhile); its own 12 tokens take 1 step.
    assert d.metrics.predicted_ttft_s == pytest.approx((40 + 1) * DECODE_S + 32 * PER_TOKEN_S)
    # e: c's slot (a's, after 30 steps) frees again after c's output. Nobody has finished yet, so that is the
    # mean expected length of the running requests: (4 + 30 + 3 + 40) // 2 = 38 steps.
    assert e.metrics.predicted_ttft_s == pytest.approx((30 + 38 + 1) * DECODE_S + 40 * PER_TOKEN_S)


def test_prompt_chunks_of_running_requests_count_as_work_ahead():
    """A running request still in prefill takes the token budget before anyone admitted after it."""
    engine = make_engine(max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=512)
    engine.add_request("long", random_prompts(1, 40, 40, seed=9)[0], greedy(4))
    engine.step()  # 16 of its 40 prompt tokens
    newcomer = engine.make_requests("new", random_prompts(1, 10, 10, seed=10)[0], greedy(4))[0]
    known_rates(engine)
    view = engine.queue_view()
    rank = view.newcomer_rank(newcomer.priority, newcomer.arrival_order)
    assert view.predict(newcomer.num_tokens, rank)[1:] == (0, 24)  # nobody waiting; 24 prompt tokens to go
    engine.enqueue([newcomer])
    # No slot wait; the 24 tokens left go first, 15 a step (the budget less a row for the running request): 2 steps,
    # then its own 10 in 1.
    assert newcomer.metrics.predicted_ttft_s == pytest.approx((2 + 1) * DECODE_S + 34 * PER_TOKEN_S)


def test_a_round_of_slots_lasts_the_mean_output_of_finished_and_running_requests():
    """Six requests of 10 output tokens finished, two run (14 and 16 tokens, 4 and 3 done): a round of the two
    slots lasts (6 x 10 + 14 + 16) // 8 = 11 steps."""
    engine = make_engine(max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=512)
    for i, prompt in enumerate(random_prompts(6, 5, 5, seed=12)):
        engine.add_request(f"done{i}", prompt, greedy(10))
    run_engine(engine)
    short, long = random_prompts(2, 10, 10, seed=6)
    engine.add_request("a", short, greedy(14))
    engine.add_request("b", long, greedy(16))
    for _ in range(4):
        engine.step()
    known_rates(engine)
    for name, length, seed in (("c", 20, 7), ("d", 12, 8), ("e", 8, 11)):
        engine.add_request(name, random_prompts(1, length, length, seed=seed)[0], greedy(4))
    e = engine.scheduler.waiting[-1]
    # e needs the third slot to free: a's (10 steps left), then c's round of 11; its 8 tokens take 1 step.
    assert e.metrics.predicted_ttft_s == pytest.approx((10 + 11 + 1) * DECODE_S + 40 * PER_TOKEN_S)
