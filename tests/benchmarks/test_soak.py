"""The soak benchmark (benchmarks.soak.soak): its summary math, its classification and arguments, without a server.
(One minute of it against a real server: tests/serving/test_soak.py.)"""

from __future__ import annotations

import os
import random

import pytest

from benchmarks.common import serve_processes
from benchmarks.soak import soak
from benchmarks.soak.soak import CLIENT, EXPECTED_4XX, LOST, OK, UNEXPECTED, Limits, Reply


# -- RSS slope ----------------------------------------------------------------------------------------------
def test_the_warm_up_is_the_first_fifth_and_at_least_two_samples():
    assert [soak.warmup_skip(n) for n in (1, 5, 10, 11, 50)] == [2, 2, 2, 3, 10]


def test_a_warm_up_given_in_seconds_skips_the_samples_taken_in_it():
    times = list(range(0, 100, 10))
    assert soak.warmup_skip(len(times), times, warmup_s=45.0) == 5
    rss = [100.0, 150.0, 180.0, 190.0, 199.0] + [200.0] * 5  # still warming at 20%, flat from 50 s
    assert soak.rss_growth_pct(times, rss) > 2.0
    assert soak.rss_growth_pct(times, rss, warmup_s=45.0) == pytest.approx(0.0, abs=1e-9)


def test_a_flat_steady_state_has_no_growth_whatever_the_warm_up_did():
    times = list(range(0, 100, 10))
    rss = [100.0, 180.0] + [200.0] * 8  # warm-up jumps, then flat
    assert soak.rss_growth_pct(times, rss) == pytest.approx(0.0, abs=1e-9)


def test_growth_is_the_slope_over_the_steady_state_in_percent_of_its_start():
    times = [float(t) for t in range(10)]
    rss = [50.0, 50.0] + [100.0 + 1.0 * (t - 2) for t in times[2:]]  # +1 MiB/s from 100 MiB at t=2 to 107 at t=9
    assert soak.rss_growth_pct(times, rss) == pytest.approx(7.0)
    rng = random.Random(0)
    noisy = [r + rng.uniform(-0.01, 0.01) for r in rss]
    assert soak.rss_growth_pct(times, noisy) == pytest.approx(7.0, abs=0.1)


def test_growth_needs_three_samples_after_the_warm_up():
    assert soak.rss_growth_pct([0, 1, 2, 3], [1, 2, 3, 4]) is None
    assert soak.rss_growth_pct([0, 1, 2, 3, 4], [1, 2, 3, 3, 3]) == pytest.approx(0.0)


def _procs(*rows):
    return [{"pid": pid, "role": role, "title": "", "rss_mb": rss, "fds": fds} for pid, role, rss, fds in rows]


def test_processes_are_summed_per_role_with_the_worst_growth_and_fds_between_pauses():
    samples = [{"t": 0.0, "kind": "idle:baseline", "processes": _procs((1, "proxy", 100, 10))}]
    for t in range(10):  # pid 1 grows 1 MiB/s from t=2; pid 2 (same role) is flat; pid 3 dies at t=5
        rows = [(1, "proxy", 100.0 + max(0, t - 2), 50 + t), (2, "proxy", 200.0, 20)]
        if t < 5:
            rows.append((3, "replica", 300.0, 30))
        samples.append({"t": float(t), "kind": "periodic", "processes": _procs(*rows)})
    first_pause = _procs((1, "proxy", 101, 60), (2, "proxy", 200, 20), (3, "replica", 300, 30))
    samples.insert(4, {"t": 2.5, "kind": "idle:pause 0", "processes": first_pause})
    last_pause = _procs((1, "proxy", 107, 62), (2, "proxy", 200, 21))
    samples.append({"t": 9.5, "kind": "idle:pause 1", "processes": last_pause})
    summary = soak.summarize_processes(samples)
    proxy = summary["proxy"]
    assert proxy["processes"] == 2 and proxy["rss_growth_pid"] == 1
    assert proxy["rss_growth_pct"] == pytest.approx(7.0)
    assert (proxy["rss_start_mb"], proxy["rss_end_mb"]) == (300.0, 307.0)
    # fds come from the pauses, never from the baseline or the periodic samples taken under load
    assert (proxy["fd_start"], proxy["fd_end"]) == (80, 83)
    replica = summary["replica"]
    assert replica["rss_growth_pct"] == pytest.approx(0.0)  # 5 samples: 3 after the warm-up
    assert replica["fd_start"] is None  # gone by the last pause: nothing to compare


# -- classification and verdict -----------------------------------------------------------------------------
@pytest.mark.parametrize("scenario, reply, chaos, category", [
    ("completion", Reply(200, done=True), False, OK),
    ("completion_stream", Reply(200, done=False), False, UNEXPECTED),  # no [DONE]
    ("completion_stream", Reply(200, done=True, error_code="x", error_message="boom"), False, UNEXPECTED),
    ("chat", Reply(200, done=True, body_ok=False), False, UNEXPECTED),
    ("chat", Reply(429, done=True), False, EXPECTED_4XX),
    ("chat", Reply(400, done=True), False, UNEXPECTED),  # a good request refused
    ("chat", Reply(500, done=True), False, UNEXPECTED),
    ("embeddings", Reply(exception="ConnectError"), False, UNEXPECTED),
    ("bad_input", Reply(400, done=True), False, EXPECTED_4XX),
    ("bad_input", Reply(404, done=True), False, EXPECTED_4XX),
    ("bad_input", Reply(200, done=True), False, UNEXPECTED),  # accepted
    ("bad_input", Reply(503, done=True), False, UNEXPECTED),
    ("timeout", Reply(504, done=True, error_code="timeout"), False, CLIENT),
    ("timeout", Reply(200, done=True, error_code="timeout", error_message="timed out"), False, CLIENT),
    ("timeout", Reply(429, done=True), False, EXPECTED_4XX),  # deadline refused as unmeetable
    ("timeout", Reply(500, done=True), False, UNEXPECTED),
    ("completion", Reply(504, done=True, error_code="timeout"), False, UNEXPECTED),  # no deadline was asked for
    ("disconnect", Reply(200, cut_by_client=True), False, CLIENT),
    ("abort", Reply(cut_by_client=True), False, CLIENT),
    ("chat_stream", Reply(200, done=True, error_code="replica_lost", error_message="cut"), True, LOST),
    ("chat", Reply(503, done=True, error_code="replica_lost"), True, LOST),
    ("chat_stream", Reply(200, done=True, error_code="replica_lost", error_message="cut"), False, UNEXPECTED),
])
def test_every_response_is_classified(scenario, reply, chaos, category):
    assert soak.classify(scenario, reply, chaos)[0] == category


def _summary(**overrides):
    summary = {"processes": {"proxy": {"rss_growth_pct": 1.0, "rss_growth_pid": 7, "fd_start": 60, "fd_end": 62},
                             "engine": {"rss_growth_pct": None, "rss_growth_pid": None, "fd_start": None,
                                        "fd_end": None}},
               "num_5xx": 0, "num_unexpected": 0, "num_lost": 0, "num_ok": 10, "idle_checks_total": 3,
               "idle_checks_passed": 3, "chaos": False, "num_kills": 0}
    return {**summary, **overrides}


def test_a_clean_run_passes():
    assert soak.verdict(_summary(), Limits()) == (True, [])


def test_each_broken_check_is_a_reason_to_fail():
    processes = {"proxy": {"rss_growth_pct": 2.5, "rss_growth_pid": 7, "fd_start": 60, "fd_end": 69}}
    passed, reasons = soak.verdict(_summary(processes=processes, num_5xx=2, num_unexpected=3, idle_checks_passed=2,
                                            num_ok=0), Limits())
    assert not passed
    assert [r.split()[0] for r in reasons] == ["RSS", "open", "2", "3", "1", "no"], reasons


def test_lost_requests_fail_only_when_no_loss_is_required():
    chaos = _summary(chaos=True, num_kills=2, num_lost=4)
    assert soak.verdict(chaos, Limits())[0]
    assert soak.verdict(chaos, Limits(require_no_loss=True))[1] == ["4 requests lost to replica kills"]
    assert soak.verdict(_summary(chaos=True), Limits())[1] == ["chaos mode killed no replica"]


def test_a_role_may_have_a_limit_of_its_own():
    processes = {"engine": {"rss_growth_pct": 30.0, "rss_growth_pid": 9, "fd_start": 4, "fd_end": 4}}
    assert not soak.verdict(_summary(processes=processes), Limits())[0]
    assert soak.verdict(_summary(processes=processes), Limits(role_max_rss_growth_pct={"engine": 40.0}))[0]


# -- processes and /stats ---------------------------------------------------------------------------------
@pytest.mark.parametrize("title, app, role", [
    ("ray::ProxyActor", None, "proxy"),
    ("ray::ServeController.listen_for_change", None, "controller"),
    ("ray::ServeReplica:inflight:Router", None, "router"),
    ("ray::ServeReplica:inflight:LLMReplica.initialize_and_get_metadata", "inflight", "replica"),
    ("ray::ServeReplica:fuzz:LLMReplica", "inflight", None),  # another app's
    ("ray::IDLE", None, None),
    ("/usr/bin/python -m inflight.engine.engine_core_child /tmp/x/core.sock", None, None),  # found as a replica's child
])
def test_serve_processes_are_told_apart_by_title(title, app, role):
    assert serve_processes.role_of(title, app) == role


def test_process_samples_read_from_proc_have_a_role_rss_and_fds():
    for p in serve_processes.sample_processes():  # empty unless a Ray Serve runs on this machine
        assert p["role"] and p["rss_mb"] > 0 and p["fds"] >= 0 and p["cpu_s"] >= 0 and p["pid"] != os.getpid()


def test_cpu_by_role_sums_each_roles_processes_present_in_both_samples():
    before = [{"pid": 1, "role": "router", "cpu_s": 1.0}, {"pid": 2, "role": "replica", "cpu_s": 5.0},
              {"pid": 3, "role": "replica", "cpu_s": 2.0}, {"pid": 4, "role": "proxy", "cpu_s": 9.0}]
    after = [{"pid": 1, "role": "router", "cpu_s": 1.5}, {"pid": 2, "role": "replica", "cpu_s": 6.0},
             {"pid": 3, "role": "replica", "cpu_s": 2.25}, {"pid": 5, "role": "proxy", "cpu_s": 3.0}]
    assert serve_processes.cpu_by_role(before, after) == {"router": 0.5, "replica": 1.25}


def test_idle_needs_a_replica_and_nothing_running_waiting_in_kv_or_in_flight():
    replica = {"replica_id": "a", "num_running": 0, "num_waiting": 0, "kv_blocks_used": 0}
    assert soak.is_idle({"replicas": [replica], "router": {"in_flight": 0}}) == (True, "")
    assert not soak.is_idle({"replicas": [], "router": {"in_flight": 0}})[0]
    assert not soak.is_idle({"replicas": [{**replica, "kv_blocks_used": 3}], "router": {"in_flight": 0}})[0]
    assert not soak.is_idle({"replicas": [replica], "router": {"in_flight": 1}})[0]
    assert not soak.is_idle({"error": "ConnectError"})[0]


@pytest.mark.parametrize("argv", [[], ["--minutes", "0"], ["--minutes", "1", "--concurrency", "0"],
                                  ["--minutes", "1", "--pause-every", "5", "--pause-s", "5"],
                                  ["--minutes", "1", "--require-no-loss"],
                                  ["--minutes", "1", "--warmup-minutes", "1"],
                                  ["--minutes", "1", "--role-max-rss-growth-pct", "engine"]])
def test_bad_arguments_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        soak.parse_args(argv)
    assert exit_info.value.code == 2 and "error:" in capsys.readouterr().err


def test_pauses_default_to_a_quarter_of_the_run_within_bounds():
    assert soak.parse_args(["--minutes", "1"]).pause_every == 15.0
    assert soak.parse_args(["--minutes", "4"]).pause_every == 60.0
    assert soak.parse_args(["--minutes", "60"]).pause_every == 120.0
