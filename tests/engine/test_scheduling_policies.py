"""Priorities with a starvation bound, admission modes, and who gets preempted.

Convention (vLLM's): a LOWER ``priority`` value is served first. With ``scheduling_policy="priority"``
a request that has waited ``max_queue_wait_s`` since it arrived goes ahead of everything younger,
preempting a running request if it must, so no request waits longer than that for its first
admission (plus one step) however many urgent requests keep arriving.
"""

from __future__ import annotations

import itertools
import time

import pytest

from tests.engine.helpers import (fake_step, greedy, hand_clock, make_engine, make_request, make_scheduler,
                                  random_prompts)


STEP_S = 0.01  # how far the engine's clock moves per step in ``flood``


def flood(monkeypatch, max_queue_wait_s, seconds_cap: float) -> float | None:
    """A priority-10 request behind a never-ending flood of priority-0 requests (always two waiting),
    two batch slots. Returns how long it waited for its first token, or None if it never got one
    within ``seconds_cap``. Time is the engine's clock, which moves ``STEP_S`` a step (``hand_clock``): how long
    the machine takes for a step decides nothing."""
    clock = hand_clock(monkeypatch)
    engine = make_engine(scheduling_policy="priority", max_queue_wait_s=max_queue_wait_s, max_num_seqs=2,
                         max_num_batched_tokens=64, num_kv_blocks=256)
    prompts = itertools.cycle(random_prompts(16, 4, 12, seed=3))
    names = itertools.count()

    def add_urgent():
        engine.add_request(f"urgent-{next(names)}", next(prompts), greedy(6), priority=0)

    for _ in range(4):
        add_urgent()
    engine.step()  # the slots are taken by urgent work before the low-priority request arrives
    clock.advance(STEP_S)
    start = clock.time()
    engine.add_request("patient", next(prompts), greedy(3), priority=10)
    while clock.time() - start < seconds_cap:
        while engine.stats()["num_waiting"] < 3:  # the patient one plus at least two urgent ones
            add_urgent()
        for output in engine.step():
            if output.request_id == "patient" and output.outputs[0].token_ids:
                return clock.time() - start
        clock.advance(STEP_S)
    return None


def test_starvation_bound_under_a_flood_of_urgent_requests(monkeypatch):
    waited = flood(monkeypatch, max_queue_wait_s=0.5, seconds_cap=5.0)
    assert waited is not None and waited <= 0.5 + 1.0, waited


def test_without_aging_the_flood_starves_the_low_priority_request(monkeypatch):
    """The flood is real: with aging off the patient request gets nothing in 2 s (sanity for the test above)."""
    assert flood(monkeypatch, max_queue_wait_s=None, seconds_cap=2.0) is None


def test_lower_priority_value_is_admitted_first():
    scheduler = make_scheduler(scheduling_policy="priority", max_num_seqs=1)
    for name, priority in (("late-low", 5), ("urgent", 0), ("mid", 2)):
        request = make_request(name, 4, max_tokens=1)
        request.priority = priority
        scheduler.add(request)
    order = []
    while scheduler.has_unfinished():
        out, _ = fake_step(scheduler)
        order.extend(r for r in out.request_ids if r not in order)
    assert order == ["urgent", "mid", "late-low"]


def test_fcfs_ignores_priority():
    scheduler = make_scheduler(max_num_seqs=1)
    for name, priority in (("first", 5), ("second", 0)):
        request = make_request(name, 4, max_tokens=1)
        request.priority = priority
        scheduler.add(request)
    out, _ = fake_step(scheduler)
    assert out.request_ids == ["first"]


def test_priority_arrival_preempts_the_worst_running_request():
    scheduler = make_scheduler(scheduling_policy="priority", max_num_seqs=2)
    background = [make_request(f"bg{i}", 4, max_tokens=50) for i in range(2)]
    for i, request in enumerate(background):
        request.priority = 5 + i  # bg1 is the worse of the two
        scheduler.add(request)
    fake_step(scheduler)
    urgent = make_request("urgent", 4, max_tokens=2)
    scheduler.add(urgent)
    out, _ = fake_step(scheduler)
    assert "urgent" in out.request_ids and "bg1" not in out.request_ids
    assert scheduler.preemption.num_preemptions == 1 and background[1] in scheduler.waiting
    scheduler.kv.check_invariants()


def preemption_workload(mode: str):
    """Long generations on a pool that cannot hold them all at full length."""
    engine = make_engine(admission_mode=mode, block_size=4, num_kv_blocks=40, max_num_seqs=6,
                         max_num_batched_tokens=32, enable_prefix_caching=False)
    prompts = random_prompts(6, 10, 20, seed=9)
    from tests.engine.helpers import generate_ids

    ids = generate_ids(engine, prompts, greedy(24))
    return engine, ids


def test_guaranteed_no_evict_never_preempts_where_max_utilization_does():
    greedy_engine, greedy_ids = preemption_workload("max_utilization")
    safe_engine, safe_ids = preemption_workload("guaranteed_no_evict")
    assert greedy_engine.scheduler.preemption.num_preemptions > 0
    assert safe_engine.scheduler.preemption.num_preemptions == 0
    assert safe_ids == greedy_ids  # the same tokens either way
    assert safe_engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("name,value", [("scheduling_policy", "sjf"), ("max_queue_wait_s", -1.0),
                                        ("admission_mode", "eager")])
def test_bad_policy_arguments_are_named(name, value):
    with pytest.raises(ValueError, match=name):
        make_engine(**{name: value})


def test_an_aged_request_once_admitted_is_not_preempted_by_urgent_work():
    scheduler = make_scheduler(scheduling_policy="priority", max_queue_wait_s=5.0, max_num_seqs=1)
    old = make_request("old", 4, max_tokens=20, arrival_time=time.time() - 10)  # waited 10 s already: aged
    old.priority = 9
    scheduler.add(old)
    fake_step(scheduler)
    assert old in scheduler.running and old.aged
    for i in range(3):
        scheduler.add(make_request(f"urgent{i}", 4, max_tokens=2))  # priority 0, fresh
        out, _ = fake_step(scheduler)
        assert out.request_ids == ["old"]
    assert scheduler.preemption.num_preemptions == 0


def test_a_request_preempted_after_admission_does_not_age_into_preempting_others(monkeypatch):
    """Its first admission ended its wait: aging it again would let it preempt in turn (a cascade)."""
    clock = hand_clock(monkeypatch)  # "victim" is 1 s short of aging: a slow machine must not age it
    scheduler = make_scheduler(scheduling_policy="priority", max_queue_wait_s=5.0, max_num_seqs=1)
    victim = make_request("victim", 4, max_tokens=20, arrival_time=clock.time() - 4)  # not aged yet
    victim.priority = 5
    scheduler.add(victim)
    fake_step(scheduler)
    scheduler.add(make_request("urgent", 4, max_tokens=30))  # priority 0 preempts the priority-5 victim
    fake_step(scheduler)
    assert victim in scheduler.waiting and scheduler.preemption.num_preemptions == 1
    victim.metrics.arrival_time -= 60  # long past the bound now, but it was admitted once
    out, _ = fake_step(scheduler)
    assert out.request_ids == ["urgent"] and not victim.aged and scheduler.preemption.num_preemptions == 1


@pytest.mark.timeout(20)
def test_making_room_for_an_aged_request_that_still_does_not_fit_ends():
    """An aged request preempts the last-ranked running one that jumped it, still does not fit (the rest are
    protected), and the victim, which would fit, must not be readmitted and preempted again in a loop."""
    scheduler = make_scheduler(num_kv_blocks=10, block_size=4, max_num_seqs=4, max_queue_wait_s=30.0,
                               max_num_batched_tokens=64, enable_prefix_caching=False, scheduling_policy="priority")
    old = make_request("old", 24, max_tokens=4, arrival_time=time.time() - 100)  # aged: 6 blocks
    waiting = make_request("aged", 20, max_tokens=4)  # 5 blocks > 4 free; fresh for now
    waiting.priority = 9
    scheduler.add(old)
    scheduler.add(waiting)
    fake_step(scheduler)
    victim = make_request("victim", 4, max_tokens=30)  # 1 block; priority 0: it jumps "aged"
    scheduler.add(victim)
    fake_step(scheduler)
    assert {r.request_id for r in scheduler.running} == {"old", "victim"} and waiting in scheduler.waiting
    victim.metrics.arrival_time -= 200  # older than "aged" now, but it has been scheduled: never ages
    waiting.metrics.arrival_time -= 40  # aged
    out, _ = fake_step(scheduler)
    assert out.request_ids == ["old"]
    assert victim in scheduler.waiting and waiting in scheduler.waiting and scheduler.preemption.num_preemptions == 1
    scheduler.kv.check_invariants()


def test_age_does_not_preempt_a_request_that_arrived_first():
    """Under fcfs nothing jumps the queue: a request that aged waiting for a slot waits for earlier arrivals to
    finish, and preempting one of them would only recompute it (an overloaded engine aged every waiting request
    into doing so)."""
    scheduler = make_scheduler(num_kv_blocks=16, block_size=4, max_num_seqs=2, max_queue_wait_s=30.0,
                               enable_prefix_caching=False)
    first, second = make_request("first", 12, max_tokens=4), make_request("second", 12, max_tokens=8)  # 4 blocks each
    late = make_request("late", 12, max_tokens=4)
    for request in (first, second, late):
        scheduler.add(request)
    fake_step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["first", "second"] and late in scheduler.waiting
    late.metrics.arrival_time -= 100  # aged
    ran = []
    while scheduler.running or scheduler.waiting:
        out, _ = fake_step(scheduler)
        ran.append(out.request_ids)
    assert scheduler.preemption.num_preemptions == 0 and late.aged
    first_of_late = next(i for i, ids in enumerate(ran) if "late" in ids)
    assert first_of_late > max(i for i, ids in enumerate(ran) if "first" in ids)  # once a slot freed
