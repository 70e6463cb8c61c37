"""Unit tests (no Ray) for the routing policies and the admission controller."""

from __future__ import annotations

import msgspec
from collections import Counter

import pytest

from inflight.engine.block_hash import block_hashes
from inflight.serve_app import admission, routing
from inflight.serve_app.admission import AdmissionController, DrainRate
from inflight.serve_app.errors import OverloadedError
from inflight.serve_app.messages import ReplicaStats
from inflight.serve_app.routing import (
    MAX_STATS_AGE_S,
    POLICIES,
    ReplicaLoad,
    RoutingPolicy,
    PrefixIndex,
    fresh_stats,
    prompt_block_hashes,
)
from tests.engine.helpers import HandClock

pytestmark = pytest.mark.timeout(30)

NOW = 1_000_000.0  # the clock of the routing and admission modules here: how long a test takes decides nothing


@pytest.fixture(autouse=True)
def frozen_clock(monkeypatch):
    for module in (routing, admission):
        monkeypatch.setattr(module, "time", HandClock(NOW))


def stats(running: int = 0, waiting: int = 0, kv_free: int = 100, kv_total: int = 100, max_num_seqs: int = 8,
          age_s: float = 0.0) -> ReplicaStats:
    return ReplicaStats(num_running=running, num_waiting=waiting, kv_blocks_free=kv_free, kv_blocks_total=kv_total,
                        max_num_seqs=max_num_seqs, time=NOW - age_s)


def load(replica_id: str, in_flight: int = 0, **kw) -> ReplicaLoad:
    raw = stats(**kw) if kw else None
    return ReplicaLoad(replica_id, in_flight, fresh_stats(raw))


def first(policy: RoutingPolicy, loads, key=None) -> str:
    ranked = policy.rank(loads, key)
    assert sorted(r.replica_id for r in ranked) == sorted(r.replica_id for r in loads), "rank must be a permutation"
    return ranked[0].replica_id


# -- least_loaded ---------------------------------------------------------------------------------------
def test_least_loaded_picks_lowest_score():
    loads = [load("a", running=6, waiting=2), load("b", running=1), load("c", running=3, kv_free=60)]  # scores 1.0, 0.125, 0.775
    ranked = RoutingPolicy("least_loaded", seed=0).rank(loads)
    assert [r.replica_id for r in ranked] == ["b", "c", "a"]
    assert [r.score() for r in ranked] == sorted(r.score() for r in loads)


def test_least_loaded_counts_kv_usage():
    # Same queue, but "a" has its KV memory nearly full: "b" wins.
    loads = [load("a", running=2, kv_free=5), load("b", running=2, kv_free=95)]
    assert first(RoutingPolicy("least_loaded", seed=0), loads) == "b"


def test_in_flight_counts_so_a_burst_spreads():
    """Between two stats reports every replica looks idle; the router's own in-flight count must spread a burst."""
    policy = RoutingPolicy("least_loaded", seed=1)
    reports = {rid: stats() for rid in ("a", "b", "c")}  # all report idle, and stay fresh during the burst
    in_flight = Counter()
    for _ in range(30):
        loads = [ReplicaLoad(rid, in_flight[rid], fresh_stats(reports[rid])) for rid in reports]
        in_flight[first(policy, loads)] += 1
    assert sorted(in_flight.values()) == [10, 10, 10], in_flight


def test_in_flight_wins_over_an_optimistic_report():
    # "a" reported 0 running, but this router has 5 requests in flight to it: that is its real load.
    loads = [ReplicaLoad("a", 5, fresh_stats(stats(running=0))), ReplicaLoad("b", 1, fresh_stats(stats(running=1)))]
    assert first(RoutingPolicy("least_loaded", seed=0), loads) == "b"


def test_stale_stats_are_ignored():
    old = stats(running=8, waiting=20, kv_free=0, age_s=MAX_STATS_AGE_S + 0.5)
    assert fresh_stats(old) is None
    assert fresh_stats(stats(age_s=MAX_STATS_AGE_S - 0.3)) is not None
    assert fresh_stats(ReplicaStats(num_running=0)) is None  # no timestamp: cannot be trusted
    assert fresh_stats(None) is None
    # A stale report of heavy load must not keep traffic away: only the in-flight count (0) counts.
    loads = [ReplicaLoad("busy-long-ago", 0, fresh_stats(old)),
             ReplicaLoad("some-load-now", 0, fresh_stats(stats(running=2)))]
    assert first(RoutingPolicy("least_loaded", seed=0), loads) == "busy-long-ago"
    # ...while a fresh report of the same load does.
    loads[0] = ReplicaLoad("busy-long-ago", 0, fresh_stats(msgspec.structs.replace(old, time=NOW)))
    assert first(RoutingPolicy("least_loaded", seed=0), loads) == "some-load-now"


# -- power_of_two -----------------------------------------------------------------------------------------
def test_power_of_two_prefers_the_lighter_of_its_pair():
    policy = RoutingPolicy("power_of_two", seed=3)
    loads = [load("a", running=8), load("b", running=4), load("c", running=1), load("d", running=2)]
    picks = Counter(first(policy, loads) for _ in range(400))
    assert picks["a"] == 0, f"the most loaded replica is the lighter of no pair: {picks}"
    assert set(picks) == {"b", "c", "d"}, picks  # random pairs: not always the global minimum
    assert picks["c"] > picks["d"] > picks["b"], picks  # lighter replicas win more pairs


def test_power_of_two_single_replica():
    assert first(RoutingPolicy("power_of_two", seed=0), [load("only", running=3)]) == "only"


# -- round_robin -----------------------------------------------------------------------------------------
def test_round_robin_cycles_regardless_of_load():
    policy = RoutingPolicy("round_robin")
    loads = [load("b", running=7), load("c"), load("a", running=3)]  # order given does not matter
    picks = [first(policy, loads) for _ in range(7)]
    assert picks == ["a", "b", "c", "a", "b", "c", "a"]
    ranked = policy.rank(loads)
    assert [r.replica_id for r in ranked] == ["b", "c", "a"]  # fallbacks continue the cycle


# -- prefix_affinity -------------------------------------------------------------------------------------
BS = 4  # block size of these tests


def hashes(tokens: list[int]) -> list[int]:
    return block_hashes(tokens, BS)


SYSTEM = list(range(100, 124))  # a 24-token "system prompt": 6 full blocks


def test_prefix_affinity_follows_the_replica_that_was_sent_the_prefix():
    policy = RoutingPolicy("prefix_affinity", seed=0)
    loads = [load("r1", running=2), load("r2", running=1), load("r3", running=2)]
    home = first(policy, loads, hashes(SYSTEM + [1, 2, 3, 4]))
    assert home == "r2", "a prefix nobody has seen goes to the least loaded replica"
    # Later requests sharing the prefix follow it, whatever else they add, even once it is a little busier.
    busier = [load("r1", running=2), load("r2", running=3), load("r3", running=2)]
    for tail in ([9, 9, 9, 9, 9], [5, 6, 7, 8], []):
        assert first(policy, busier, hashes(SYSTEM + tail)) == "r2"
    # A different prefix goes to the least loaded (then sticks there).
    other = list(range(500, 520))
    assert first(policy, busier, hashes(other)) in ("r1", "r3")
    assert first(policy, [load("r1", running=4), load("r2", running=4), load("r3", running=4)],
                 hashes(other)) == first(policy, busier, hashes(other))


def test_prefix_affinity_prefers_the_longest_match():
    policy = RoutingPolicy("prefix_affinity", seed=0)
    idle = [load("r1"), load("r2")]
    policy.prefix_index.record("r1", hashes(SYSTEM[:8]), 100)  # the first 2 blocks
    policy.prefix_index.record("r2", hashes(SYSTEM), 100)  # all 6
    assert policy.prefix_index.num_matched("r1", hashes(SYSTEM)) == 2
    assert policy.prefix_index.num_matched("r2", hashes(SYSTEM)) == 6
    assert first(policy, idle, hashes(SYSTEM + [7, 7, 7, 7])) == "r2"
    # same tokens in the second block, but a different first block: a block hash names its whole prefix
    assert policy.prefix_index.num_matched("r2", hashes([0, 0, 0, 0] + SYSTEM[4:])) == 0


def test_prefix_affinity_falls_back_when_home_is_overloaded():
    policy = RoutingPolicy("prefix_affinity", seed=0, load_cap=1.5)
    idle = [load("r1", running=1), load("r2", running=1), load("r3", running=1)]
    home = first(policy, idle, hashes(SYSTEM))
    overloaded = [load(r.replica_id, running=8, waiting=16, kv_free=0) if r.replica_id == home
                  else load(r.replica_id, running=1) for r in idle]
    ranked = policy.rank(overloaded, hashes(SYSTEM))
    assert ranked[0].replica_id != home, "an overloaded home must not get the request"
    assert ranked[-1].replica_id == home
    assert ranked[0].score() == min(r.score() for r in overloaded)
    # No prompt blocks (shorter than a block, or no token ids): plain least-loaded.
    assert first(policy, overloaded, []) != home


def test_prefix_index_is_bounded_and_forgets_departed_replicas():
    index = PrefixIndex()
    index.record("r1", hashes(SYSTEM), capacity=4)  # 6 blocks into room for 4: the oldest 2 are forgotten
    assert index.num_matched("r1", hashes(SYSTEM)) == 0  # the run starts at the first block, now forgotten
    index.record("r1", hashes(SYSTEM[:8]), capacity=4)  # sent again: most recently used
    assert index.num_matched("r1", hashes(SYSTEM)) == 2
    index.record("r2", hashes(SYSTEM), capacity=100)
    index.forget_except({"r1"})
    assert index.num_matched("r2", hashes(SYSTEM)) == 0
    assert index.num_matched("r1", hashes(SYSTEM)) == 2


def test_prompt_block_hashes_use_the_replicas_block_size():
    tokens = list(range(40))
    assert prompt_block_hashes(tokens, [None, ReplicaStats(block_size=16)]) == block_hashes(tokens, 16)
    assert prompt_block_hashes(tokens, [ReplicaStats(num_running=0)]) == []  # no report yet
    assert prompt_block_hashes(None, [ReplicaStats(block_size=16)]) == []


def test_policy_edge_cases():
    with pytest.raises(ValueError, match="routing_policy"):
        RoutingPolicy("fastest")
    for name in POLICIES:
        assert RoutingPolicy(name, seed=0).rank([]) == []


# -- admission -------------------------------------------------------------------------------------------
def test_admission_bounds_in_flight():
    ctl = AdmissionController(3)
    assert [ctl.try_acquire() for _ in range(3)] == [None, None, None]
    assert ctl.in_flight == 3
    for i in range(5):
        retry = ctl.try_acquire()
        assert retry is not None and retry >= 1.0, retry
        assert ctl.in_flight == 3
    assert ctl.num_rejected == 5
    ctl.release()
    assert ctl.try_acquire() is None
    assert ctl.try_acquire() is not None
    assert ctl.in_flight == 3


def test_admission_retry_after_at_least_one_second():
    ctl = AdmissionController(1)
    assert ctl.try_acquire() is None
    for _ in range(1000):  # a very fast drain rate must still not advise retrying in under a second
        ctl.drain.record()
    ctl.drain._last -= 2.0
    ctl.drain.record()
    retry = ctl.try_acquire()
    assert retry is not None and retry >= 1.0, retry
    # The header is integer seconds >= 1.
    for seconds, header in [(0.01, "1"), (0.4, "1"), (1.0, "1"), (2.6, "3"), (30.2, "30")]:
        value = OverloadedError("busy", retry_after_s=seconds).headers()["Retry-After"]
        assert value == header and int(value) >= 1


def test_drain_rate_estimate_grows_with_queue():
    drain = DrainRate(initial_per_s=4.0)
    assert drain.seconds_to_drain(1) == 1.0
    assert drain.seconds_to_drain(40) == pytest.approx(10.0)
    assert drain.seconds_to_drain(80) > drain.seconds_to_drain(40)


def test_admission_rejects_bad_bound():
    with pytest.raises(ValueError):
        AdmissionController(0)


def test_a_replica_without_a_report_yet_takes_its_share_of_a_burst():
    """A replica that just started has not reported yet: it is scored per batch slot like its peers (their slot
    count), not per request, or a burst would give it a quarter of what a reporting idle replica gets."""
    policy = RoutingPolicy("least_loaded", seed=0)
    in_flight = Counter()
    for _ in range(16):
        loads = [ReplicaLoad("reported", in_flight["reported"], fresh_stats(stats(max_num_seqs=4))),
                 ReplicaLoad("new", in_flight["new"], None)]
        in_flight[first(policy, loads)] += 1
    assert in_flight == {"reported": 8, "new": 8}
