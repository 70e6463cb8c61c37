"""Async scheduling: step N+1 is scheduled and launched before step N's tokens are back, and the results
must be exactly those of the synchronous loop.

One mixed workload runs through both loops, driven step by step with the same additions and aborts at
the same points: stop strings, stop tokens, min_tokens, max_tokens, seeded sampling, logprobs, n > 1,
priorities, shared prefixes (prefix caching), preemption by recompute and by swap (a KV pool too small
for everyone), prompt scoring and embeddings (the prefill lane), an abort after k tokens and deadlines.
Every request's outputs must match; the streamed deltas must join to the final output (nothing emitted
after a stop); every KV block must be free at the end; and a request may cost at most one wasted row.
"""

from __future__ import annotations

import collections

import pytest

from inflight.engine import PoolingParams, SamplingParams
from tests.engine.helpers import greedy, launch_ahead, make_engine, random_prompts

PREFIX = random_prompts(1, 24, 24, seed=5)[0]
PROMPTS = [PREFIX + p for p in random_prompts(6, 3, 10, seed=6)] + random_prompts(6, 8, 30, seed=7)
ABORT_AFTER = 5  # tokens request "abort" gets before it is aborted


def engine_for(async_scheduling: bool, preemption_mode: str):
    # ~30 blocks of 4 tokens: the 13 long requests cannot all hold their KV at once, so some are preempted
    return make_engine(async_scheduling=async_scheduling, num_kv_blocks=30, max_num_seqs=8,
                       max_num_batched_tokens=32, scheduling_policy="priority", preemption_mode=preemption_mode,
                       swap_space_bytes=1 << 20 if preemption_mode == "swap" else 0)


def workload(stop_string: str, stop_token: int) -> list[tuple[int, str, list[int], object, int]]:
    """(step to add at, request id, prompt, params, priority)."""
    def sampled(**kw):
        return SamplingParams(temperature=0.8, top_p=0.9, seed=11, output_kind="delta", **{"max_tokens": 30, **kw})

    def greedy(**kw):
        return SamplingParams(temperature=0.0, output_kind="delta", **{"max_tokens": 30, **kw})

    requests = [
        (0, "stop-string", PROMPTS[0], greedy(stop=[stop_string], ignore_eos=True), 0),
        (0, "stop-token", PROMPTS[1], greedy(stop_token_ids=[stop_token], ignore_eos=True), 1),
        (0, "min-tokens", PROMPTS[2], greedy(stop_token_ids=[stop_token], min_tokens=12, ignore_eos=True), 0),
        (0, "seeded-n2", PROMPTS[3], sampled(n=2, logprobs=2, ignore_eos=True), 2),
        (1, "abort", PROMPTS[4], greedy(ignore_eos=True, max_tokens=40), 0),
        (1, "eos", PROMPTS[5], greedy(max_tokens=40), 1),
        (2, "score", PROMPTS[6], SamplingParams(max_tokens=0, prompt_logprobs=1), 0),
        (2, "embed", PROMPTS[7], PoolingParams(), 0),
        (3, "deadline-queued", PROMPTS[8], greedy(timeout_s=1e-4, reject_unmeetable_deadline=False), 0),
    ]
    for i, prompt in enumerate(PROMPTS[9:]):
        requests.append((4 + i, f"late-{i}", prompt, greedy(ignore_eos=True, max_tokens=20 + 5 * i), i % 3))
    return requests


def drive(engine, requests) -> tuple[dict, dict, dict]:
    """Add each request at its step, abort "abort" once it has ABORT_AFTER tokens, step to the end.
    Returns every request's outputs in order, its final output, and the rows that sampled for each of
    its sequences."""
    sampled_rows: collections.Counter = collections.Counter()
    launch = engine.runner.launch  # every step the device computes is launched (execute = launch + collect)

    def counting_launch(batch, sampling):
        for request_id, sample in zip(batch.request_ids, batch.sample):
            sampled_rows[request_id] += sample
        return launch(batch, sampling)

    engine.runner.launch = counting_launch
    pending = sorted(requests, key=lambda r: r[0])
    seen: dict[str, list] = collections.defaultdict(list)
    tokens_of: collections.Counter = collections.Counter()
    sequences: dict[str, list[str]] = {}
    aborted = False
    for step in range(2000):
        while pending and pending[0][0] <= step:
            _, request_id, prompt, params, priority = pending.pop(0)
            engine.add_request(request_id, prompt, params, priority=priority)
            sequences[request_id] = [child.request_id for child in engine._children[request_id]]
        if not pending and not engine.has_unfinished_requests():
            break
        for output in engine.step():
            seen[output.request_id].append(output)
            tokens_of[output.request_id] += len(output.outputs[0].token_ids)
        if not aborted and tokens_of["abort"] >= ABORT_AFTER:
            engine.abort_request("abort")
            aborted = True
    else:
        raise AssertionError("the engine did not finish")
    rows = {rid: [sampled_rows[child] for child in children] for rid, children in sequences.items()}
    return seen, {rid: outs[-1] for rid, outs in seen.items()}, rows


def joined(outputs, index=0):
    """A delta stream's tokens and text, joined."""
    pieces = [o.outputs[index] for o in outputs]
    return [t for p in pieces for t in p.token_ids], "".join(p.text for p in pieces)


@pytest.fixture(scope="module")
def stops():
    """A stop string and a stop token that greedy decoding of PROMPTS[0] and PROMPTS[1] reaches mid-way."""
    engine = make_engine()
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    engine.add_request("b", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            final[out.request_id] = out.outputs[0]
    text = final["a"].text
    # a printable ASCII character first seen a few characters in (demo-tiny's bytes are mostly not ASCII text)
    fresh = [c for i, c in enumerate(text) if i >= 3 and c.isascii() and c.isalnum() and c not in text[:i]]
    assert fresh, f"demo-tiny's text has no character to stop on: {text!r}"
    return fresh[0], final["b"].token_ids[6]


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize("pipelined", [False, True], ids=["computed-at-launch", "launched-ahead"])
def test_async_scheduling_gives_the_synchronous_results(stops, preemption_mode, pipelined, monkeypatch):
    stop_string, stop_token = stops
    requests = workload(stop_string, stop_token)
    sync_engine, async_engine = engine_for(False, preemption_mode), engine_for(True, preemption_mode)
    assert not sync_engine.async_scheduling and async_engine.async_scheduling
    sync_seen, sync_final, _ = drive(sync_engine, requests)
    ahead = launch_ahead(monkeypatch, async_engine.runner) if pipelined else None
    async_seen, async_final, async_rows = drive(async_engine, requests)
    if pipelined:
        assert len(ahead) > 20, "steps were not launched before the step before them was collected"

    assert async_final.keys() == sync_final.keys() == {r[1] for r in requests}
    for request_id, want in sync_final.items():
        got = async_final[request_id]
        assert got.finished
        for index, (w, g) in enumerate(zip(want.outputs, got.outputs)):
            got_tokens, want_tokens = joined(async_seen[request_id], index)[0], joined(sync_seen[request_id], index)[0]
            if w.finish_reason == "timeout":  # a deadline is wall time: how far each got may differ, not what
                shorter, longer = sorted([got_tokens, want_tokens], key=len)
                assert longer[:len(shorter)] == shorter and g.finish_reason == "timeout", request_id
                continue
            assert joined(async_seen[request_id], index) == joined(sync_seen[request_id], index), request_id
            assert g.finish_reason == w.finish_reason and g.stop_reason == w.stop_reason, request_id
        if want.embedding is not None:
            assert got.embedding == pytest.approx(want.embedding, rel=1e-5)
    first = {rid: outs[0] for rid, outs in async_seen.items()}
    assert first["score"].prompt_logprobs == sync_seen["score"][0].prompt_logprobs

    # the features under test really happened
    assert sync_final["stop-string"].outputs[0].finish_reason == "stop"
    assert async_final["stop-token"].outputs[0].stop_reason == stop_token
    assert len(joined(async_seen["min-tokens"])[0]) >= 12
    assert async_final["abort"].outputs[0].finish_reason == "abort"
    assert len(joined(async_seen["abort"])[0]) == ABORT_AFTER, "no token after the abort"
    assert async_final["deadline-queued"].outputs[0].finish_reason == "timeout"
    for engine in (sync_engine, async_engine):
        stats = engine.stats()
        assert stats["num_preemptions"] > 0, "the KV pool must be small enough to preempt"
        assert stats["prefix_cache_hit_tokens"] > 0
        assert stats["kv_blocks_used"] == 0 and stats["num_running"] == stats["num_waiting"] == 0
    if preemption_mode == "swap":
        assert async_engine.stats()["num_swapped_out_bytes"] > 0

    # wasted rows: a request that stops on a sampled token may have one more row in flight; never more, and
    # none past max_tokens (the scheduler knows that one in advance)
    for request_id, out in async_final.items():
        for index, completion in enumerate(out.outputs):
            produced = len(joined(async_seen[request_id], index)[0])
            rows = async_rows[request_id][index]
            if completion.finish_reason == "length":
                assert rows == produced, (request_id, rows, produced)
            else:
                assert rows <= produced + 1, (request_id, rows, produced)


def test_static_batching_refuses_async_scheduling():
    with pytest.raises(ValueError, match="async_scheduling"):
        make_engine(batching="static", async_scheduling=True)


def test_a_scheduled_batch_keeps_its_block_tables_while_the_next_step_grows_them():
    """With async scheduling the runner prepares step N+1 on the device thread while the host thread schedules
    N+2, which grows the KV manager's block tables. The batch the runner reads holds copies taken when it was
    scheduled, from the general path and from the persistent batch alike: growing the live tables (and freeing
    them) after ``schedule`` changes nothing in it, so no row's KV writes or reads can move."""
    engine = make_engine(async_scheduling=False)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), prompt, greedy(40))
    scheduler, seen_persistent = engine.scheduler, False
    for _ in range(30):
        batch = scheduler.schedule()
        seen_persistent |= scheduler.scheduled_by_persistent_batch() is not None
        before = [list(table) for table in batch.block_tables]
        for request_id, table in zip(batch.request_ids, batch.block_tables):
            live = scheduler.kv.block_tables[request_id]
            assert table is not live and table == live
            live.append(10_000)  # what an allocation for the next step would do, in place
        assert batch.block_tables == before
        for request_id in batch.request_ids:
            scheduler.kv.block_tables[request_id].pop()
        scheduler.update([7 if sample else None for sample in batch.sample])
    assert seen_persistent  # both paths were exercised
