"""The persistent batch: decode steps over an unchanged running set run from arrays kept across steps
(engine/persistent_batch.py), and must give exactly what the general path gives.

Each workload runs twice per loop (synchronous and async scheduling), with the persistent batch on and off
(the engine argument ``persistent_batch``), driven step by step with the same additions and aborts: every request's
streamed tokens, text, finish and stop reasons must match; the batch must really have run (most decode steps);
the prefix cache must have hashed the same decoded blocks; every KV block must be free at the end.
"""

from __future__ import annotations

import pytest

from inflight.engine import SamplingParams
from tests.engine.helpers import make_engine, random_prompts
from tests.engine.test_async_scheduling import drive, joined, stops, workload  # noqa: F401 (a fixture)

DECODE_PROMPTS = random_prompts(10, 5, 14, seed=21)


def decode_heavy(stop_token: int, decoded_prefix: list[int]) -> list[tuple[int, str, list[int], object, int]]:
    """Ten requests decoding together in a queue that stays full (fcfs, six slots): no stop token on most, eos or
    a stop token on others (so the rows' stop sets differ), min_tokens, max_tokens that end rows mid-batch, an abort, and
    late arrivals whose prompts repeat an earlier request's prompt, and its output so far (prefix-cache hits on
    blocks that decode steps filled)."""
    def greedy(**kw):
        return SamplingParams(temperature=0.0, output_kind="delta", **{"max_tokens": 40, "ignore_eos": True, **kw})

    requests = [(0, f"plain-{i}", DECODE_PROMPTS[i], greedy(max_tokens=30 + 7 * i), 0) for i in range(4)]
    requests += [
        (0, "eos", DECODE_PROMPTS[4], greedy(ignore_eos=False, max_tokens=60), 0),
        (0, "stop-token", DECODE_PROMPTS[5], greedy(stop_token_ids=[stop_token]), 0),
        (1, "min-tokens", DECODE_PROMPTS[5], greedy(stop_token_ids=[stop_token], min_tokens=15), 0),
        (1, "abort", DECODE_PROMPTS[7], greedy(max_tokens=60), 0),
        (2, "seeded", DECODE_PROMPTS[8], SamplingParams(temperature=0.9, seed=3, max_tokens=35, ignore_eos=True,
                                                        output_kind="delta"), 0),
        (3, "again-0", DECODE_PROMPTS[0], greedy(max_tokens=12), 0),
        (60, "again-1", decoded_prefix, greedy(max_tokens=12), 0),
    ]
    return requests


def greedy_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    engine = engine_for(False, False)
    engine.add_request("probe", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return next(o for o in iter(engine.step, None) if o and o[0].finished)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def decode_stop() -> int:
    """A token greedy decoding of DECODE_PROMPTS[5] reaches at its 11th step."""
    return greedy_tokens(DECODE_PROMPTS[5], 12)[10]


@pytest.fixture(scope="module")
def decoded_prefix() -> list[int]:
    """"plain-1"'s prompt and the first 24 tokens it generates: blocks only decode steps fill."""
    return DECODE_PROMPTS[1] + greedy_tokens(DECODE_PROMPTS[1], 24)


def engine_for(async_scheduling: bool, persistent: bool, **overrides):
    return make_engine(async_scheduling=async_scheduling, persistent_batch=persistent, **overrides)


def test_persistent_batch_is_a_checked_engine_argument_and_static_batching_has_none():
    with pytest.raises(ValueError, match="persistent_batch"):
        make_engine(persistent_batch="yes")
    assert not make_engine(batching="static").scheduler.kept.enabled
    assert make_engine().scheduler.kept.enabled


def assert_same_results(requests, got_seen, got_final, want_seen, want_final) -> None:
    assert got_final.keys() == want_final.keys() == {r[1] for r in requests}
    for request_id, want in want_final.items():
        got = got_final[request_id]
        assert got.finished, request_id
        for index, (w, g) in enumerate(zip(want.outputs, got.outputs)):
            if w.finish_reason == "timeout":  # a deadline is wall time: how far each got may differ, not what
                continue
            assert joined(got_seen[request_id], index) == joined(want_seen[request_id], index), request_id
            assert (g.finish_reason, g.stop_reason) == (w.finish_reason, w.stop_reason), request_id


@pytest.mark.parametrize("admission_mode", ["max_utilization", "guaranteed_no_evict"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_decode_steps_from_the_persistent_batch_give_the_general_paths_results(decode_stop, decoded_prefix,
                                                                              async_scheduling, admission_mode):
    """(guaranteed_no_evict reserves every block a request may need at admission: the batch never allocates.)"""
    requests = decode_heavy(decode_stop, decoded_prefix)
    runs = {}
    for persistent in (True, False):
        engine = engine_for(async_scheduling, persistent, max_num_seqs=6, num_kv_blocks=200,
                            admission_mode=admission_mode)
        runs[persistent] = (engine, *drive(engine, requests))
    (kept, kept_seen, kept_final, kept_rows), (general, seen, final, _) = runs[True], runs[False]
    assert_same_results(requests, kept_seen, kept_final, seen, final)
    # No row past a request's last token: one whose max_tokens is in flight is not scheduled again (async).
    for request_id, out in kept_final.items():
        if out.outputs[0].finish_reason == "length":
            assert kept_rows[request_id][0] == len(joined(kept_seen[request_id])[0]), request_id

    # the features under test happened, on the persistent path
    assert kept_final["stop-token"].outputs[0].stop_reason == decode_stop
    assert len(joined(kept_seen["min-tokens"])[0]) >= 15
    assert kept_final["abort"].outputs[0].finish_reason == "abort"
    # each change of the running set costs general steps (a prefill, the first decode over the new set; with async
    # scheduling also the step that skips a row whose last token is in flight): ten requests over six slots churn
    assert kept.scheduler.kept.num_steps > kept.num_steps / 4, (kept.scheduler.kept.num_steps,
                                                                      kept.num_steps)
    assert general.scheduler.kept.num_steps == 0
    kept_stats, stats = kept.stats(), general.stats()
    # "again-1" arrives after "plain-1" decoded 24 tokens: both paths hashed the blocks decode steps filled
    assert kept_stats["prefix_cache_hit_tokens"] == stats["prefix_cache_hit_tokens"] >= len(decoded_prefix) - 4
    for s in (kept_stats, stats):
        assert s["kv_blocks_used"] == 0 and s["num_running"] == s["num_waiting"] == 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_mixed_workload_gives_the_same_results_with_the_persistent_batch(stops, async_scheduling):
    """Async scheduling's mixed workload (preemption, n > 1, logprobs, the prefill lane, priorities, deadlines):
    the persistent batch steps in only where it may, and changes nothing."""
    stop_string, stop_token = stops
    requests = workload(stop_string, stop_token)
    runs = {}
    for persistent in (True, False):
        engine = engine_for(async_scheduling, persistent, num_kv_blocks=30, max_num_seqs=8,
                            max_num_batched_tokens=32, scheduling_policy="priority", preemption_mode="recompute")
        runs[persistent] = (engine, *drive(engine, requests)[:2])
    (kept, kept_seen, kept_final), (_, seen, final) = runs[True], runs[False]
    assert_same_results(requests, kept_seen, kept_final, seen, final)
    assert kept.scheduler.kept.num_steps > 0
    assert kept.stats()["num_preemptions"] > 0 and kept.stats()["kv_blocks_used"] == 0


def test_a_row_whose_next_block_cannot_be_had_goes_to_the_general_path_which_preempts():
    """Four requests decode in a pool that cannot hold all of them to the end: when a row fills its last block
    and none is free, the persistent batch steps aside; the general path preempts, and the results are those
    of the engine without the persistent batch."""
    prompts = random_prompts(4, 6, 6, seed=4)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=20)
    results = {}
    for persistent in (True, False):
        engine = engine_for(False, persistent, num_kv_blocks=16, max_num_seqs=4)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = out.outputs[0].token_ids
        results[persistent] = (outputs, engine.stats()["num_preemptions"], engine.scheduler.kept.num_steps)
    (kept, kept_preemptions, kept_steps), (general, preemptions, _) = results[True], results[False]
    assert kept == general and kept_preemptions == preemptions > 0 and kept_steps > 0


@pytest.mark.parametrize("shared", [True, False], ids=["one-stop-set", "stop-sets-differ"])
def test_a_stop_token_ends_a_row_of_the_persistent_batch_unless_min_tokens_holds_it(shared):
    """The vectorised stop test (one set for all rows, or each row's own) flags rows; the request's own rules
    decide (min_tokens)."""
    prompt = DECODE_PROMPTS[9]
    tokens = greedy_tokens(prompt, 12)
    stop = tokens[8]  # a token greedy decoding reaches at the 9th step
    first = tokens.index(stop) + 1

    def params(**kw):
        return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **kw)

    finals = {}
    for persistent in (True, False):
        engine = engine_for(False, persistent)
        engine.add_request("early", prompt, params(stop_token_ids=[stop]))
        engine.add_request("held", prompt, params(stop_token_ids=[stop], min_tokens=11))
        if not shared:
            engine.add_request("free", prompt, params())
        final = finals[persistent] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                final[out.request_id] = out.outputs[0]
        assert (engine.scheduler.kept.num_steps > 0) == persistent
    final = finals[True]
    assert {k: (v.token_ids, v.finish_reason, v.stop_reason) for k, v in final.items()} == {
        k: (v.token_ids, v.finish_reason, v.stop_reason) for k, v in finals[False].items()}
    assert final["early"].token_ids == tokens[:first] and final["early"].stop_reason == stop
    assert len(final["held"].token_ids) >= 11 and stop not in final["held"].token_ids[:10]
    if not shared:
        assert final["free"].token_ids == tokens and final["free"].finish_reason == "length"


def test_the_persistent_batch_hashes_each_block_a_decode_step_fills_into_the_prefix_cache():
    """After every step, a running request's full blocks are all in the prefix cache, as on the general path
    (which hashes whatever is full): a later request with the same tokens finds them while this one runs."""
    engine = engine_for(False, True)
    kv, block_size = engine.scheduler.kv, engine.scheduler.kv.block_size
    for i in range(3):
        engine.add_request(f"r{i}", DECODE_PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.scheduler.running:
            assert kv.num_hashed_blocks(request.request_id) == request.num_computed_tokens // block_size
            checked += 1
    assert checked > 60 and engine.scheduler.kept.num_steps > 20


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_what_the_batch_keeps_per_step_in_flight_does_not_grow_without_prefix_caching(async_scheduling):
    """The rows filling a block are noted per step scheduled and taken when it is applied, cache or no cache."""
    engine = engine_for(async_scheduling, True, enable_prefix_caching=False)
    for i in range(3):
        engine.add_request(f"r{i}", DECODE_PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    longest = 0
    while engine.has_unfinished_requests():
        engine.step()
        batch = engine.scheduler.kept.batch
        if batch is not None:
            longest = max(longest, len(batch._filling))
    assert engine.scheduler.kept.num_steps > 20 and longest <= (2 if async_scheduling else 1)
