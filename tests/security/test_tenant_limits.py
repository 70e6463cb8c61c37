"""serve_app.admission.TenantLimiter on a fake clock: requests in flight and a token bucket per tenant,
refunds and overage settled from actual usage, Retry-After from the refill rate."""

from __future__ import annotations

import pytest

from inflight.serve_app.admission import TenantLimiter, TenantLimits


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_requests_in_flight_per_tenant():
    limiter = TenantLimiter({"a": TenantLimits(max_concurrent_requests=2)})
    assert limiter.try_admit("a", 10) is None and limiter.try_admit("a", 10) is None
    retry, why = limiter.try_admit("a", 10)
    assert retry > 0 and "in flight" in why
    assert limiter.try_admit("b", 10) is None, "another tenant (no limits) is not held back"
    limiter.release("a", 10, 5)
    assert limiter.try_admit("a", 10) is None


def test_token_budget_refills_and_settles_from_usage():
    clock = Clock()
    limiter = TenantLimiter({}, TenantLimits(tokens_per_minute=600), clock=clock)  # 10 tokens a second
    assert limiter.try_admit("a", 500) is None
    retry, why = limiter.try_admit("a", 200)
    assert retry == pytest.approx(10.0) and "per minute" in why  # 100 left, 200 wanted: 100 more at 10/s
    limiter.release("a", 500, 100)  # used 100 of 500: 400 come back
    assert limiter.try_admit("a", 450) is None
    limiter.release("a", 450, 900)  # used twice its reservation: the bucket goes below zero
    retry, _ = limiter.try_admit("a", 10)
    assert retry > 30
    clock.now += retry
    assert limiter.try_admit("a", 10) is None, "after Retry-After seconds the retry is admitted"


def test_a_reservation_over_a_minutes_budget_waits_for_a_full_bucket():
    clock = Clock()
    limiter = TenantLimiter({"a": TenantLimits(tokens_per_minute=60)}, clock=clock)
    assert limiter.try_admit("a", 1000) is None  # capped at the bucket: never refused forever
    retry, _ = limiter.try_admit("a", 1000)
    assert retry == pytest.approx(60.0)
