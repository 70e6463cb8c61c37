"""Scheduler unit tests with a fake runner: schedule(), then update() with chosen token ids."""

from __future__ import annotations

from inflight.engine.request import Request, RequestStatus
from inflight.engine.sampling_params import SamplingParams
from tests.engine.helpers import EOS_ID, fake_step, hand_clock, make_request, make_requests, make_scheduler


def blocks_used(scheduler) -> int:
    return scheduler.kv.pool.num_used


# -- continuous ---------------------------------------------------------------------------------------

def test_finished_request_slot_and_blocks_are_reused_next_step():
    # one slot, and exactly the blocks one request needs (8 + 2 tokens = 3 blocks of 4)
    scheduler = make_scheduler(num_kv_blocks=3, max_num_seqs=1)
    a, b = make_requests([8, 8], max_tokens=2)
    scheduler.add(a)
    scheduler.add(b)
    out, _ = fake_step(scheduler)  # a prefills
    assert out.request_ids == ["r0"] and list(scheduler.waiting) == [b]
    out, _ = fake_step(scheduler)  # a decodes its 2nd and last token
    assert out.request_ids == ["r0"]
    assert a.is_finished and a.finish_reason == "length"
    assert "r0" not in scheduler.kv.block_tables and blocks_used(scheduler) == 0, \
        "a's blocks must go back in the step it finished"
    out, _ = fake_step(scheduler)
    assert out.request_ids == ["r1"], "the waiting request takes the freed slot in the very next step"
    assert b.status is RequestStatus.RUNNING and scheduler.running == [b]
    assert len(out.block_tables[0]) == 2


def test_chunked_prefill_respects_budget_and_decodes_go_first():
    scheduler = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    a = make_request("a", 3, max_tokens=20)
    scheduler.add(a)
    fake_step(scheduler)  # a prefilled, now decoding
    b, c = make_request("b", 20, max_tokens=3), make_request("c", 5, max_tokens=3)
    scheduler.add(b)
    scheduler.add(c)
    seen_b = []
    for _ in range(6):
        out, _ = fake_step(scheduler)
        assert out.num_tokens <= 8
        assert out.request_ids[0] == "a" and out.query_lens[0] == 1 and out.sample[0], "decodes are scheduled first"
        assert sum(out.query_lens) == out.num_tokens
        if "b" in out.request_ids:
            i = out.request_ids.index("b")
            seen_b.append((out.start_positions[i], out.query_lens[i], out.sample[i]))
    # b's prompt of 20 arrives in chunks of what is left of the budget, each starting where the last ended
    assert seen_b[0] == (0, 7, False)
    starts = [s for s, _, _ in seen_b]
    ends = [s + n for s, n, _ in seen_b]
    assert starts[1:] == ends[:-1]
    last_prefill = next(k for k, (s, n, _) in enumerate(seen_b) if s + n == 20)
    assert [smp for _, _, smp in seen_b[:last_prefill]] == [False] * last_prefill
    assert seen_b[last_prefill][2] is True
    # c waited behind b (FIFO): admitted only once b's prefill no longer takes the whole budget
    assert c.num_computed_tokens > 0


def test_preemption_evicts_newest_running_request():
    # a and b use 2 blocks each (7 prompt tokens); the 4-block pool is then full
    scheduler = make_scheduler(num_kv_blocks=4, max_num_seqs=4)
    a, b = make_requests([7, 7], max_tokens=6)
    scheduler.add(a)
    scheduler.add(b)
    fake_step(scheduler)  # both prefill: 8 tokens each after sampling
    fake_step(scheduler)  # both decode within their 2nd block: 9 tokens each
    late = make_request("late", 2, max_tokens=2)
    scheduler.add(late)
    assert blocks_used(scheduler) == 4
    out = scheduler.schedule()  # a needs a 3rd block: b (the newest running) is preempted
    assert out.request_ids == ["r0"]
    assert scheduler.running == [a]
    assert list(scheduler.waiting) == [b, late], "the preempted request goes to the front of the queue"
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert "r1" not in scheduler.kv.block_tables and blocks_used(scheduler) == 3, "b's blocks are freed this step"
    assert scheduler.preemption.num_preemptions == 1 and scheduler.preemption.num_recomputed_tokens == 8
    assert b.metrics.num_preemptions == 1
    scheduler.update([100])
    scheduler.kv.check_invariants()


def test_preempted_request_is_recomputed_from_scratch():
    scheduler = make_scheduler(num_kv_blocks=4, max_num_seqs=4, max_num_batched_tokens=32, enable_prefix_caching=False)
    a, b = make_requests([7, 7], max_tokens=3)
    for r in (a, b):
        scheduler.add(r)
    for _ in range(3):
        fake_step(scheduler)
    assert scheduler.preemption.num_preemptions == 1
    assert a.is_finished
    out, _ = fake_step(scheduler)  # b comes back: all its tokens (prompt + 2 generated) in one row
    assert out.request_ids == ["r1"]
    assert out.start_positions == [0] and out.query_lens == [9] and out.sample == [True]
    assert out.input_token_ids == b.all_token_ids[:9]


def test_preempted_request_resumes_from_its_cached_full_blocks():
    """With prefix caching its full blocks stay cached when it is preempted; if nobody took them over,
    it gets them back and computes only the rest."""
    scheduler = make_scheduler(num_kv_blocks=4, max_num_seqs=4, max_num_batched_tokens=32, block_size=4)
    a = make_request("a", 7, max_tokens=3)
    b = Request("b", list(range(100, 107)), SamplingParams(temperature=0.0, max_tokens=3), max_model_len=4096,
                eos_token_ids=frozenset({EOS_ID}))  # a different prompt: nothing shared with a
    for r in (a, b):
        scheduler.add(r)
    for _ in range(3):
        fake_step(scheduler)
    assert scheduler.preemption.num_preemptions == 1 and a.is_finished
    out, _ = fake_step(scheduler)  # b: its first block (4 tokens) was full and computed: taken from the cache
    assert out.request_ids == ["b"]
    assert out.start_positions == [4] and out.query_lens == [5] and out.sample == [True]
    assert scheduler.num_prefix_hit_tokens == 4
    scheduler.kv.check_invariants()


def test_abort_frees_blocks_immediately():
    scheduler = make_scheduler(num_kv_blocks=16, max_num_seqs=1)
    a, b = make_requests([9, 5])
    scheduler.add(a)
    scheduler.add(b)
    fake_step(scheduler)
    assert blocks_used(scheduler) == 3
    assert scheduler.abort("r0") is a
    assert blocks_used(scheduler) == 0 and "r0" not in scheduler.kv.block_tables
    assert a.is_finished and a.finish_reason == "abort" and a not in scheduler.running
    assert scheduler.abort("r1") is b  # waiting: leaves the queue
    assert not scheduler.waiting and not scheduler.has_unfinished()
    assert scheduler.drain_ended_without_token() == [a, b]
    assert scheduler.abort("r0") is None and scheduler.abort("unknown") is None
    scheduler.kv.check_invariants()


def test_request_larger_than_kv_pool_is_rejected_or_finishes():
    """prompt + max_tokens beyond the whole pool: reject it at add(), or end it; never spin forever."""
    scheduler = make_scheduler(num_kv_blocks=4, max_num_seqs=2, max_num_batched_tokens=32)  # 16 token slots
    request = make_request("big", 10, max_tokens=20)
    try:
        scheduler.add(request)
    except ValueError as e:
        assert "num_kv_blocks" in str(e) or "max_tokens" in str(e)
        return
    for _ in range(200):
        fake_step(scheduler)
        if not scheduler.has_unfinished():
            break
    assert request.is_finished, (f"livelock: {request} after 200 steps, "
                                 f"{scheduler.preemption.num_preemptions} preemptions of a request that can never fit")


def test_timeout_ends_request_and_frees_blocks(monkeypatch):
    clock = hand_clock(monkeypatch)  # a slow machine must not end "slow" before its first step
    scheduler = make_scheduler(num_kv_blocks=16)
    slow = make_request("slow", 6, max_tokens=50, timeout_s=0.2)
    queued = make_request("queued", 6, max_tokens=50, timeout_s=5.0, arrival_time=clock.time() - 10)
    other = make_request("other", 6, max_tokens=50)
    scheduler.add(slow)
    fake_step(scheduler)
    assert blocks_used(scheduler) == 2
    scheduler.add(queued)  # already past its deadline when it is first scheduled
    scheduler.add(other)
    clock.advance(0.25)
    out, _ = fake_step(scheduler)
    assert out.request_ids == ["other"]
    for r in (slow, queued):
        assert r.is_finished and r.finish_reason == "timeout"
        assert r.request_id not in scheduler.kv.block_tables
    assert set(scheduler.drain_ended_without_token()) == {slow, queued}
    assert blocks_used(scheduler) == 2  # only other's
    scheduler.kv.check_invariants()


# -- static -------------------------------------------------------------------------------------------------

def test_static_batch_forms_only_when_prompt_plus_max_tokens_is_reservable():
    scheduler = make_scheduler(num_kv_blocks=6, batching="static", max_num_seqs=4)
    a, b = make_requests([8, 8], max_tokens=8)  # 16 tokens = 4 blocks each; only one fits in 6
    scheduler.add(a)
    scheduler.add(b)
    out, _ = fake_step(scheduler)
    assert out.request_ids == ["r0"], "b's prompt would fit, but its prompt + max_tokens does not"
    assert len(scheduler.kv.block_tables["r0"]) == 4, "the whole prompt + max_tokens is reserved up front"
    assert list(scheduler.waiting) == [b]


def test_static_batch_lockstep_padding_and_release():
    scheduler = make_scheduler(num_kv_blocks=32, batching="static", max_num_seqs=4)
    short, long = make_request("short", 5, max_tokens=2), make_request("long", 6, max_tokens=5)
    scheduler.add(short)
    scheduler.add(long)
    out, _ = fake_step(scheduler)  # both prefill
    assert out.request_ids == ["short", "long"]
    late = make_request("late", 3, max_tokens=2)
    scheduler.add(late)
    held = {rid: list(t) for rid, t in scheduler.kv.block_tables.items()}
    steps = 1
    while long.num_output_tokens < 5:
        short_was_finished = short.is_finished
        out, _ = fake_step(scheduler)
        steps += 1
        assert "late" not in out.request_ids, "nobody joins a running batch"
        # finished members stay in the batch until the longest ends, as padding rows after the others
        assert out.request_ids == (["long", "short"] if short_was_finished else ["short", "long"])
        if short_was_finished:
            assert out.padding == [False, True] and out.sample == [True, False]
        if not long.is_finished:
            assert scheduler.kv.block_tables.get("short") == held["short"], "a padding row keeps its blocks"
    assert short.output_token_ids and len(short.output_token_ids) == 2, "padding rows get no tokens"
    assert steps == 5
    # the batch ended in that update: everything is returned, and the next batch forms
    assert "short" not in scheduler.kv.block_tables and "long" not in scheduler.kv.block_tables
    assert blocks_used(scheduler) == 0
    out, _ = fake_step(scheduler)
    assert out.request_ids == ["late"]


def test_static_member_aborted_before_prefill_is_not_a_bogus_padding_row():
    """A member ended before any of its tokens was computed has no 'last position' to recompute."""
    scheduler = make_scheduler(num_kv_blocks=32, batching="static", max_num_seqs=4, max_num_batched_tokens=8)
    a, b = make_request("a", 8, max_tokens=4), make_request("b", 6, max_tokens=4)
    scheduler.add(a)
    scheduler.add(b)
    out, _ = fake_step(scheduler)  # the budget only covers a's prompt
    assert out.request_ids == ["a"]
    scheduler.abort("b")
    while scheduler.has_unfinished():
        out, _ = fake_step(scheduler)
        for rid, start, qlen in zip(out.request_ids, out.start_positions, out.query_lens):
            assert start >= 0 and qlen >= 1, f"row {rid} at position {start}: nothing of it is in the cache"
    assert a.num_output_tokens == 4 and blocks_used(scheduler) == 0


# -- admission headroom (kv_headroom_tokens) ---------------------------------------------------------------

def _run_to_the_end(scheduler, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not scheduler.running and not scheduler.waiting:
            return
        fake_step(scheduler)
    raise AssertionError("the scheduler did not finish its requests")


def test_admission_headroom_spares_the_preemptions_decode_growth_causes():
    """Twelve requests of 16 prompt tokens and 12 outputs (7 blocks of 4 each) on 16 blocks. Admitted while the
    next chunk fits (0), a third prompt takes blocks the first two need to decode, and decode growth preempts
    (and recomputes) requests; the more of each request's growth admission keeps free, the fewer; with all of
    it (12), none."""
    def preempted(headroom: int) -> tuple[int, int]:
        scheduler = make_scheduler(num_kv_blocks=16, max_num_seqs=4, kv_headroom_tokens=headroom)
        for request in make_requests([16] * 12, max_tokens=12):
            scheduler.add(request)
        _run_to_the_end(scheduler)
        assert blocks_used(scheduler) == 0
        return scheduler.preemption.num_preemptions, scheduler.preemption.num_recomputed_tokens

    greedy, some, all_of_it = preempted(0), preempted(8), preempted(12)
    assert greedy[0] > some[0] > 0 and greedy[1] > some[1]
    assert all_of_it == (0, 0)


def test_a_request_alone_is_admitted_whatever_the_headroom():
    """With nothing running, a request whose prompt fits but whose prompt + headroom does not is still admitted
    (it would otherwise wait for ever)."""
    scheduler = make_scheduler(num_kv_blocks=4, max_num_seqs=2, kv_headroom_tokens=64)
    (request,) = make_requests([15], max_tokens=1)
    scheduler.add(request)
    out, _ = fake_step(scheduler)
    assert out.request_ids == ["r0"] and request.is_finished


def test_kv_headroom_tokens_must_be_a_count():
    import pytest

    from tests.engine.helpers import make_config

    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="kv_headroom_tokens"):
            make_config(kv_headroom_tokens=bad)
