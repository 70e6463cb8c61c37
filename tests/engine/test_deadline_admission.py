"""Deadline-aware admission: the engine predicts time to first token and refuses what it cannot meet."""

from __future__ import annotations

import asyncio

import pytest

from engine import AsyncLLMEngine, DeadlineUnmeetableError, SamplingParams
from engine.ttft_predictor import MIN_OBSERVATIONS, TTFTPredictor
from tests.engine.helpers import ENGINE_DEFAULTS, greedy, make_engine, random_prompts, run_engine


DECODE_S, PER_TOKEN_S = 0.003, 1e-4


def fitted(budget=64, slots=4) -> TTFTPredictor:
    predictor = TTFTPredictor(budget, slots)
    for tokens in [0, 0, 64, 32, 0, 50, 0, 20, 60]:
        predictor.observe(DECODE_S + PER_TOKEN_S * tokens, tokens, 2)
    return predictor


def test_predictor_measures_decode_steps_and_prefill_cost_per_token():
    predictor = fitted()
    assert predictor.ready
    assert predictor.decode_step_s == pytest.approx(DECODE_S)
    assert predictor.per_prefill_token_s == pytest.approx(PER_TOKEN_S)
    assert predictor.step_seconds(100) == pytest.approx(DECODE_S + 100 * PER_TOKEN_S)


def test_prediction_counts_prefill_chunks_and_waiting_for_a_slot():
    predictor = fitted()
    # A free slot, nobody ahead: 100 prompt tokens through (64 - 2 decode rows) = 62 per step -> 2 steps.
    alone = predictor.predict(100, tokens_ahead=0, num_ahead=0, running_remaining=[5, 9])
    assert alone == pytest.approx(2 * DECODE_S + 100 * PER_TOKEN_S)
    # All 4 slots busy (remaining 3, 7, 8, 20 tokens) and one request ahead: the 2nd to end (7 steps) frees
    # ours. The 30 tokens ahead are prefilled during that wait (1 step, shorter), then our 100 (2 steps).
    busy = predictor.predict(100, tokens_ahead=30, num_ahead=1, running_remaining=[20, 3, 8, 7])
    assert busy == pytest.approx(7 * DECODE_S + 2 * DECODE_S + 100 * PER_TOKEN_S)
    # Five requests ahead: one round of all four slots, then the 2nd again; a round lasts the typical output.
    queued = predictor.predict(10, tokens_ahead=30, num_ahead=5, running_remaining=[20, 3, 8, 7], typical_output=12)
    assert queued == pytest.approx((7 + 12) * DECODE_S + DECODE_S + 10 * PER_TOKEN_S)
    # A long prefill queue ahead outlasts the slot wait: then it is what counts.
    long_queue = predictor.predict(10, tokens_ahead=6000, num_ahead=1, running_remaining=[20, 3, 8, 7])
    assert long_queue == pytest.approx(100 * DECODE_S + 6000 * PER_TOKEN_S + DECODE_S + 10 * PER_TOKEN_S)


def test_predictor_is_silent_until_it_has_seen_enough_steps():
    predictor = TTFTPredictor(64, 4)
    for _ in range(MIN_OBSERVATIONS - 1):
        predictor.observe(0.01, 10, 1)
    assert not predictor.ready


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


def test_async_engine_refuses_through_the_stream():
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
    assert engine._expected_remaining(request) == 2 * 6 - request.num_output_tokens
