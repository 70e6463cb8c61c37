"""Bounded admission: say no at once (429 + Retry-After) rather than let a queue grow without end."""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field

from inflight.serve_app.errors import OverloadedError


class DrainRate:
    """Completions per second, an exponentially weighted average over roughly the last ``window_s``."""

    def __init__(self, window_s: float = 10.0, initial_per_s: float = 1.0) -> None:
        self.window_s = window_s
        self.per_s = initial_per_s
        self._last = time.monotonic()
        self._count = 0

    def record(self, count: int = 1) -> None:
        self._count += count
        self._update()

    def _update(self) -> None:
        now = time.monotonic()
        elapsed = now - self._last
        if elapsed >= 1.0:
            alpha = min(1.0, elapsed / self.window_s)
            self.per_s = (1 - alpha) * self.per_s + alpha * (self._count / elapsed)
            self._last, self._count = now, 0

    def seconds_to_drain(self, queued: int) -> float:
        """Estimated seconds until ``queued`` requests ahead have left."""
        self._update()
        return max(1.0, queued / max(self.per_s, 0.1))


class AdmissionController:
    """At most ``max_in_flight`` requests at once; beyond that, ``try_acquire`` says how long to wait."""

    def __init__(self, max_in_flight: int) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self.drain = DrainRate()
        self.num_rejected = 0

    def try_acquire(self) -> float | None:
        """None if admitted (call ``release`` when done); otherwise the suggested Retry-After in seconds."""
        if self.in_flight >= self.max_in_flight:
            self.num_rejected += 1
            return self.drain.seconds_to_drain(self.in_flight - self.max_in_flight + 1)
        self.in_flight += 1
        return None

    def release(self) -> None:
        self.in_flight -= 1
        self.drain.record()


class TenantLimits(BaseModel):
    """One tenant's bounds at a router: requests in flight, and prompt + output tokens per minute."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    max_concurrent_requests: int | None = Field(default=None, ge=1)
    tokens_per_minute: int | None = Field(default=None, ge=1)


class TenantLimiter:
    """Per-tenant admission at one router (with several routers, each applies the limits to what it sees).

    Tokens are a bucket per tenant holding up to ``tokens_per_minute`` and refilled at that rate: a request
    reserves its prompt (estimated) plus ``max_tokens`` when admitted, and gets back what it did not use when
    it ends; a reservation beyond what the bucket holds waits for the refill (429 with the seconds it takes).
    """

    def __init__(self, limits: dict[str, TenantLimits], default: TenantLimits | None = None,
                 clock=time.monotonic) -> None:
        self.limits, self.default, self._clock = limits, default or TenantLimits(), clock
        self.in_flight: dict[str, int] = {}
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, when)

    def limits_of(self, tenant: str) -> TenantLimits:
        return self.limits.get(tenant, self.default)

    def try_admit(self, tenant: str, tokens: int) -> tuple[float, str] | None:
        """None if admitted (call ``release``); else (Retry-After seconds, why)."""
        limits = self.limits_of(tenant)
        if limits.max_concurrent_requests is not None and self.in_flight.get(tenant, 0) >= limits.max_concurrent_requests:
            return 1.0, f"tenant has {limits.max_concurrent_requests} requests in flight (its limit)"
        rate = limits.tokens_per_minute
        if rate is not None:
            level = self._level(tenant, rate)
            wanted = min(tokens, rate)  # more than a minute's budget: wait for a full bucket
            if level < wanted:
                return (wanted - level) * 60.0 / rate, f"tenant's budget of {rate} tokens per minute is spent"
            self._buckets[tenant] = (level - wanted, self._clock())
        self.in_flight[tenant] = self.in_flight.get(tenant, 0) + 1
        return None

    def release(self, tenant: str, reserved: int, used: int | None) -> None:
        """The request ended having used ``used`` tokens (None: unknown, the reservation stands): what it did
        not use goes back, what it used beyond the reservation is taken too (the bucket may go below zero)."""
        self.in_flight[tenant] = max(0, self.in_flight.get(tenant, 0) - 1)
        rate = self.limits_of(tenant).tokens_per_minute
        if rate is not None and used is not None:
            level = self._level(tenant, rate) + min(reserved, rate) - used
            self._buckets[tenant] = (max(-float(rate), min(float(rate), level)), self._clock())

    def _level(self, tenant: str, rate: int) -> float:
        tokens, when = self._buckets.get(tenant, (float(rate), self._clock()))
        return min(float(rate), tokens + (self._clock() - when) * rate / 60.0)


class Slot:
    """A request's admission: the router's slot and, for a tenant, its share; released once, settling the
    tenant's token budget with the request's ``usage`` (``total_tokens``) when it is known."""

    def __init__(self, admission: "RouterAdmission", tenant: str | None, reserved: int) -> None:
        self.admission, self.tenant, self.reserved = admission, tenant, reserved
        self.usage: dict[str, int] = {}
        self._released = False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.admission.release(self)


class RouterAdmission:
    """The router's admission: at most ``max_pending_requests`` in flight, and each API key's tenant within its
    limits (requests in flight, tokens per minute); a refusal is a 429 with Retry-After. Counted in ``metrics``
    (``RouterMetrics``)."""

    def __init__(self, max_in_flight: int, tenant_limits: dict[str, TenantLimits],
                 default_tenant_limits: TenantLimits | None, metrics) -> None:
        self.requests = AdmissionController(max_in_flight)
        self.tenants = TenantLimiter(tenant_limits, default_tenant_limits)
        self.metrics = metrics

    def admit(self, tenant: str | None, reserved: int) -> Slot:
        """A slot for a request expected to take ``reserved`` tokens; raises ``OverloadedError``."""
        retry_after = self.requests.try_acquire()
        if retry_after is not None:
            self.metrics.rejections.inc()
            raise OverloadedError(f"server is at capacity ({self.requests.max_in_flight} requests in flight); "
                                  f"retry later", retry_after_s=retry_after)
        if tenant is not None:
            refusal = self.tenants.try_admit(tenant, reserved)
            if refusal is not None:
                self.requests.release()
                self.metrics.tenant_rejections.inc(tags={"tenant": tenant})
                retry_after, why = refusal
                raise OverloadedError(f"rate limited: {why}; retry later", retry_after_s=retry_after)
        return Slot(self, tenant, reserved)

    def release(self, slot: Slot) -> None:
        self.requests.release()
        if slot.tenant is not None:
            used = slot.usage.get("total_tokens")
            self.tenants.release(slot.tenant, slot.reserved, used)
            self.metrics.tenant_requests.inc(tags={"tenant": slot.tenant})
            if used:
                self.metrics.tenant_tokens.inc(used, tags={"tenant": slot.tenant})
