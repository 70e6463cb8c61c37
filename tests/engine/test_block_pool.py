"""Property tests: the KV block manager against a model of it, and the scheduler under random traffic."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from inflight.engine.block_pool import KVCacheManager
from inflight.engine.request import RequestStatus
from tests.engine.helpers import make_config, make_request, make_scheduler

STATEFUL = settings(max_examples=50, stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


class KVCacheMachine(RuleBasedStateMachine):
    """Allocate (grow) and free tables at random; the manager must agree with a plain dict of sizes."""

    requests = Bundle("requests")

    @initialize(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 4, 16]))
    def setup(self, num_blocks, block_size):
        self.manager = KVCacheManager(num_blocks, block_size)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.expected_blocks: dict[str, int] = {}  # request -> blocks it should hold
        self.next_id = 0

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @rule(target=requests, tokens=st.integers(0, 80))
    def new_request(self, tokens):
        rid = f"r{self.next_id}"
        self.next_id += 1
        self._grow(rid, tokens)
        return rid

    @rule(rid=requests, extra=st.integers(0, 40))
    def grow(self, rid, extra):
        held = self.expected_blocks.get(rid, 0)
        self._grow(rid, held * self.block_size + extra)

    @rule(rid=requests, tokens=st.integers(0, 40))
    def shrink_request_is_a_no_op(self, rid, tokens):
        held = self.expected_blocks.get(rid, 0)
        before = list(self.manager.block_tables.get(rid, []))
        if held and tokens <= held * self.block_size:
            assert self.manager.allocate(rid, tokens)
            assert self.manager.block_tables[rid] == before

    def _grow(self, rid, tokens):
        held = self.expected_blocks.get(rid, 0)
        need = max(self.blocks_for(tokens), held)
        used = sum(self.expected_blocks.values())
        fits = need - held <= self.num_blocks - used
        assert self.manager.can_fit(rid, tokens) == fits
        before = list(self.manager.block_tables.get(rid, []))
        ok = self.manager.allocate(rid, tokens)
        assert ok == fits
        table = self.manager.block_tables.get(rid, [])
        if ok:
            self.expected_blocks[rid] = need
            assert table[:len(before)] == before, "growing a table must keep its existing blocks in place"
            assert len(table) == need
        else:
            assert table == before, "a failed allocation must change nothing"

    @rule(rid=consumes(requests))
    def free(self, rid):
        self.manager.free(rid)
        self.expected_blocks.pop(rid, None)
        assert rid not in self.manager.block_tables

    @rule(rid=requests)
    def free_twice_is_harmless(self, rid):
        self.manager.free(rid)
        self.manager.free(rid)
        self.expected_blocks.pop(rid, None)

    @invariant()
    def invariants_hold(self):
        if not hasattr(self, "manager"):
            return
        self.manager.check_invariants()
        used = sum(self.expected_blocks.values())
        assert self.manager.pool.num_used == used
        assert self.manager.pool.num_free == self.num_blocks - used
        stats = self.manager.stats(0)
        assert (stats.num_blocks_used, stats.num_blocks_free, stats.num_blocks_total) == \
            (used, self.num_blocks - used, self.num_blocks)
        for rid, n in self.expected_blocks.items():
            assert len(self.manager.block_tables.get(rid, [])) == n
        assert all(0 <= b < self.num_blocks for t in self.manager.block_tables.values() for b in t)


KVCacheMachine.TestCase.settings = STATEFUL
test_kv_cache_manager_state_machine = KVCacheMachine.TestCase


def test_check_invariants_detects_corruption():
    """check_invariants is what the property tests lean on: it must notice a block held twice."""
    manager = KVCacheManager(8, 4)
    assert manager.allocate("a", 8) and manager.allocate("b", 4)
    manager.check_invariants()
    manager.block_tables["b"].append(manager.block_tables["a"][0])  # shared without a ref count
    with pytest.raises(AssertionError):
        manager.check_invariants()


def test_a_prefix_hits_only_as_far_as_its_window_is_cached():
    """Sliding-window layers' blocks apart (window 8, blocks of 4, a window pool of 6): a cached prefix is a hit only
    where the window blocks its first computed position reads are cached too; those given back and evicted end it."""
    manager = KVCacheManager(64, 4, enable_prefix_caching=True, window=8, num_window_blocks=6)
    tokens = list(range(7, 47))
    assert manager.allocate("a", 16)
    manager.cache_computed_blocks("a", tokens, 16)
    assert manager.allocate("a", 32, start=16)  # gives back window blocks 0, 1 (positions 0-7), evicted for 2 new
    manager.cache_computed_blocks("a", tokens, 32)
    manager.check_invariants()
    assert manager.window_tables["a"][:2] == [manager.null_window_block] * 2
    # 12 tokens in common: the block tables' 3 blocks are cached, but position 12's window starts in block 1, gone
    assert manager.match_prefix("b", tokens[:12] + [5] * 20) == 0 and "b" not in manager.block_tables
    # 20 in common: position 20 reads window blocks 3 and 4, which "a" still holds
    assert manager.match_prefix("c", tokens[:20] + [5] * 20) == 20
    assert manager.window_tables["c"] == [manager.null_window_block] * 3 + manager.window_tables["a"][3:5]
    manager.check_invariants()
    manager.free("a")
    manager.free("c")
    manager.check_invariants()
    assert manager.window_pool.num_used == manager.pool.num_used == 0


# -- the real scheduler under random traffic, with a fake runner ---------------------------------------

STOP_TOKEN = 5


def drive_scheduler(batching: str, seed: int, num_kv_blocks: int, max_num_seqs: int, max_num_batched_tokens: int,
                    num_requests: int, swap_blocks: int = 0, window: int | None = None, **config):
    """``window``: the sliding-window layers' KV apart, in as many blocks as the engine would give them; every step
    must then find in the window tables each block its tokens' windows read."""
    rng = random.Random(seed)
    block_size = 4
    window_kv = None
    if window is not None:
        from inflight.engine.kv_budget import window_blocks_needed

        window_kv = (window, window_blocks_needed(make_config(max_num_seqs=max_num_seqs, max_num_batched_tokens=
                                                              max_num_batched_tokens), window, block_size))
    scheduler = make_scheduler(num_kv_blocks, window=window_kv, block_size=block_size, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=max_num_batched_tokens, batching=batching, **config)
    scheduler.preemption.set_swap_space(swap_blocks)
    capacity = num_kv_blocks * block_size
    all_requests = []
    to_stop: set[str] = set()
    pending = num_requests
    for step in range(2000):
        # random arrivals, aborts and "the model says stop"
        if pending and rng.random() < 0.5:
            prompt_len = rng.randint(1, min(30, capacity - 1))
            # prompt + max_tokens always fits the pool alone (what the engine promises to finish)
            max_tokens = rng.randint(1, min(20, capacity - prompt_len))
            request = make_request(f"q{len(all_requests)}", prompt_len, max_tokens,
                                   stop_token_ids=[STOP_TOKEN])
            request.priority = rng.randint(0, 3)  # only the priority policy looks at it
            scheduler.add(request)
            all_requests.append(request)
            pending -= 1
        live = [r for r in all_requests if not r.is_finished]
        if live and rng.random() < 0.1:
            victim = rng.choice(live)
            assert scheduler.abort(victim.request_id) is victim
            assert victim.finish_reason == "abort"
        if live and rng.random() < 0.2:
            to_stop.add(rng.choice(live).request_id)

        out = scheduler.schedule()
        assert out.num_tokens <= max_num_batched_tokens
        assert len(scheduler.running) <= max_num_seqs
        assert out.num_rows <= max_num_seqs
        for rid, start, qlen, pad, table in zip(out.request_ids, out.start_positions, out.query_lens, out.padding,
                                                out.block_tables):
            if not pad:
                assert start >= 0 and qlen >= 1
                assert len(table) * block_size >= start + qlen, "the block table does not cover the step's tokens"
        if window is not None:
            null = scheduler.kv.null_window_block
            for start, qlen, table in zip(out.start_positions, out.query_lens, out.window_tables):
                read = table[max(0, start - window + 1) // block_size:(start + qlen - 1) // block_size + 1]
                assert null not in read and len(table) * block_size >= start + qlen, "a window block was given back"
        tokens = [None if not s else (STOP_TOKEN if rid in to_stop else rng.randrange(7, 263))
                  for rid, s in zip(out.request_ids, out.sample)]
        if not out.is_empty:
            scheduler.update(tokens)

        scheduler.kv.check_invariants()
        for request in all_requests:
            if request.is_finished and request not in scheduler.running:
                assert request.request_id not in scheduler.kv.block_tables, f"{request} finished but holds blocks"
            if request.status is RequestStatus.WAITING:
                assert request in scheduler.waiting
            if request.status is RequestStatus.RUNNING:
                assert request in scheduler.running
                assert request.request_id in scheduler.kv.block_tables
        # every prompt here starts with the same tokens, so full prefix blocks are shared: count blocks once
        assert scheduler.kv.pool.num_used == len({b for t in scheduler.kv.block_tables.values() for b in t})
        if not pending and not scheduler.has_unfinished():
            break
    else:
        pytest.fail(f"requests still unfinished after 2000 steps: {scheduler.waiting} {scheduler.running}")

    assert all(r.is_finished for r in all_requests)
    assert scheduler.kv.pool.num_used == 0 and not scheduler.kv.block_tables
    if scheduler.preemption.swap_pool is not None:  # every host block came back
        assert scheduler.preemption.swap_pool.num_free == scheduler.preemption.swap_pool.num_blocks
    for r in all_requests:
        assert r.finish_reason in ("stop", "length", "abort")
        if r.finish_reason == "length":
            assert r.num_tokens == r.max_total_tokens
        if r.finish_reason == "stop":
            assert r.output_token_ids[-1] == STOP_TOKEN
    return scheduler, all_requests


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_kv_blocks=st.integers(8, 40), max_num_seqs=st.integers(1, 6),
       max_num_batched_tokens=st.integers(6, 40), num_requests=st.integers(1, 12))
def test_continuous_scheduler_random_traffic(seed, num_kv_blocks, max_num_seqs, max_num_batched_tokens,
                                             num_requests):
    drive_scheduler("continuous", seed, num_kv_blocks, max_num_seqs, max(max_num_seqs, max_num_batched_tokens),
                    num_requests)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_kv_blocks=st.integers(13, 40), max_num_seqs=st.integers(1, 6),
       max_num_batched_tokens=st.integers(6, 40), num_requests=st.integers(1, 12))
def test_static_scheduler_random_traffic(seed, num_kv_blocks, max_num_seqs, max_num_batched_tokens, num_requests):
    drive_scheduler("static", seed, num_kv_blocks, max_num_seqs, max(max_num_seqs, max_num_batched_tokens),
                    num_requests)



@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_kv_blocks=st.integers(8, 40), max_num_seqs=st.integers(1, 6),
       max_num_batched_tokens=st.integers(6, 40), num_requests=st.integers(1, 12),
       policy=st.sampled_from(["fcfs", "priority"]), mode=st.sampled_from(["max_utilization", "guaranteed_no_evict"]),
       max_queue_wait_s=st.sampled_from([None, 1e-9, 30.0]), preemption=st.sampled_from(["recompute", "swap", "auto"]),
       swap_blocks=st.integers(0, 12))
def test_policies_and_admission_modes_keep_the_books(seed, num_kv_blocks, max_num_seqs, max_num_batched_tokens,
                                                    num_requests, policy, mode, max_queue_wait_s, preemption,
                                                    swap_blocks):
    """Random traffic under every policy, admission mode and aging setting (1e-9 s: everyone is aged at
    once): every request finishes, block accounting is exact after every step, and guaranteed_no_evict
    never preempts."""
    scheduler, _ = drive_scheduler("continuous", seed, num_kv_blocks, max_num_seqs,
                                   max(max_num_seqs, max_num_batched_tokens), num_requests, swap_blocks=swap_blocks,
                                   scheduling_policy=policy, admission_mode=mode, max_queue_wait_s=max_queue_wait_s,
                                   preemption_mode=preemption, swap_space_bytes=swap_blocks + 1)  # bytes: any > 0
    if mode == "guaranteed_no_evict":
        assert scheduler.preemption.num_preemptions == 0


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), num_kv_blocks=st.integers(8, 40), max_num_seqs=st.integers(1, 6),
       max_num_batched_tokens=st.integers(6, 40), num_requests=st.integers(1, 12), window=st.integers(1, 13),
       batching=st.sampled_from(["continuous", "static"]))
def test_sliding_window_blocks_go_back_only_out_of_every_window(seed, num_kv_blocks, max_num_seqs,
                                                                max_num_batched_tokens, num_requests, window, batching):
    """The window layers' blocks (engine/block_pool.py) under random traffic, preemption and aborts: a step's rows
    find every block their queries' windows read, the books balance after every step, all go back at the end."""
    if batching == "static":
        num_kv_blocks = max(num_kv_blocks, 13)
    scheduler, _ = drive_scheduler(batching, seed, num_kv_blocks, max_num_seqs,
                                   max(max_num_seqs, max_num_batched_tokens), num_requests, window=window)
    assert scheduler.kv.window_pool.num_used == 0 and not scheduler.kv.window_tables


def test_random_traffic_covers_swapping():
    """The swap path is reached too: KV goes out to host blocks and comes back."""
    scheduler, _ = drive_scheduler("continuous", seed=5, num_kv_blocks=12, max_num_seqs=4, max_num_batched_tokens=12,
                                   num_requests=12, swap_blocks=30, preemption_mode="swap", swap_space_bytes=1)
    assert scheduler.preemption.num_swapped_out_blocks > 0 and scheduler.preemption.num_swapped_in_blocks > 0


def test_random_traffic_covers_preemption_and_aborts():
    """The random driver really reaches the hard paths (else the properties above prove little)."""
    scheduler, requests = drive_scheduler("continuous", seed=5, num_kv_blocks=12, max_num_seqs=4,
                                          max_num_batched_tokens=12, num_requests=12)
    assert scheduler.preemption.num_preemptions > 0
    assert scheduler.num_prefix_hit_tokens > 0  # shared prompt prefixes were taken from the cache
    reasons = {r.finish_reason for r in requests}
    assert {"abort", "length", "stop"} <= reasons
