"""Bounded admission: say no at once (429 + Retry-After) rather than let a queue grow without end."""

from __future__ import annotations

import time


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
