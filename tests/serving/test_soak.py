"""Twenty seconds of benchmarks.soak.soak's mixed load against the shared demo app (the serving suite's session cluster,
started by tests/serving/fixtures.py; here, not in tests/benchmarks/, so that the session cluster starts after
the multinode tests, which need this machine free of another Ray)."""

from __future__ import annotations

import json

import pytest

from benchmarks.soak import soak
from benchmarks.soak.soak import CLIENT, EXPECTED_4XX
from tests.serving.helpers import wait_idle


@pytest.mark.timeout(240, func_only=True)
def test_twenty_seconds_of_mixed_load_leave_no_5xx_no_leak_and_idle_kv(demo_app, tmp_path, capsys):
    wait_idle(demo_app, timeout=30.0)  # an earlier test's requests would count as ours
    out = tmp_path / "soak.json"
    argv = ["--minutes", "0.35", "--url", demo_app, "--app", "inflight", "--concurrency", "6", "--sample-every", "3",
            "--pause-every", "5", "--pause-s", "2", "--json", str(out),
            # Twenty seconds are all warm-up: a fresh process's allocator, the proxy's and router's first connections
            # and caches still grow, so the per-process bound is looser than the 2% a long soak holds them to.
            "--max-rss-growth-pct", "10",
            # The engine child's heap keeps growing for minutes under this mix (~+30% in a minute, slowing: see the
            # soak's report); this bound catches a runaway leak, the long soak's default (2%) the slow one.
            "--role-max-rss-growth-pct", "engine=100"]
    try:
        code = soak.main(argv)
    finally:
        wait_idle(demo_app, timeout=60.0)  # the next test gets the app idle
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    summary = report["summary"]
    assert code == 0, printed + "\n" + json.dumps(report["not_ok"][:20], indent=1)
    assert summary["num_5xx"] == 0 and summary["num_unexpected"] == 0
    assert summary["idle_checks_total"] >= 3 and summary["idle_checks_passed"] == summary["idle_checks_total"]
    assert summary["num_ok"] > 100, summary  # the load really ran
    assert summary["by_category"].get(EXPECTED_4XX, 0) > 0  # bad inputs and the bursts' 429s
    assert summary["by_category"].get(CLIENT, 0) > 0  # disconnects, aborts and deadlines
    assert {"proxy", "router", "replica", "engine"} <= set(summary["processes"]), summary["processes"]
    assert "verdict: PASS" in printed
