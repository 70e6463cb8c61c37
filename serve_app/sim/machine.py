"""Replicas that share one machine's CPU cores: their engines' compute threads and the serving processes' own work,
shared out as the OS shares cores among runnable threads.

A profile's steps are timed with the engine alone on the machine. In a server they are not: Ray's processes,
Serve's controller, the proxy, the router and the replicas' event loops keep part of a core busy all the time
(``ServingCosts.serving_cores``, measured on a server: ``serving_costs.py``), and replicas placed on one machine
run their steps on the same cores. While the demand (each engine in a step: its compute threads; the serving
processes: their cores) exceeds the machine's cores, every step progresses at ``cores / demand`` of its speed
(processor sharing), so a step's end moves whenever another engine on the machine starts or ends one. On a GPU an
engine's step needs no core (``engine_threads`` 0) and nothing stretches.

Measured on the 2-core demo machine with 2 one-thread replicas (2026-12-07): a 600-token prompt took 1.36 s on
an idle server and 1.56 s while the other replica decoded one stream; the idle server's processes kept 0.21 of a
core busy (docs/benchmarks.md "Issue 44").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MachineShare:
    """What one machine's replicas compete for: ``cores``; each engine in a step keeps ``engine_threads`` busy; the
    serving processes keep ``serving_cores`` busy beside them."""

    cores: float
    engine_threads: float
    serving_cores: float = 0.0

    def __post_init__(self) -> None:
        if not self.cores > 0 or self.engine_threads < 0 or self.serving_cores < 0:
            raise ValueError(f"a machine needs cores > 0, engine_threads >= 0 and serving_cores >= 0, got {self}")

    def stretch(self, busy_engines: int) -> float:
        """How much longer a step takes than alone while ``busy_engines`` engines (itself included) are in a step."""
        return max(1.0, (busy_engines * self.engine_threads + self.serving_cores) / self.cores)


class SharedMachine:
    """The steps in progress on one machine: each one's work left (seconds at full speed), advanced at the shared
    speed whenever the set of busy engines changes."""

    def __init__(self, share: MachineShare) -> None:
        self.share = share
        self.work_left: dict[int, float] = {}  # replica index -> seconds of its step left at full speed
        self._since = 0.0  # when work_left was last brought up to date

    def start(self, replica: int, seconds: float, now: float) -> dict[int, float]:
        """``replica`` starts a step of ``seconds`` (alone on the machine); returns the new end time of every step
        whose end moved (the new one's included)."""
        before = self._advance(now)
        self.work_left[replica] = seconds
        return self._ends(now, before, replica)

    def end(self, replica: int, now: float) -> dict[int, float]:
        """``replica``'s step ended; returns the new end time of every step whose end moved."""
        before = self._advance(now)
        del self.work_left[replica]
        return self._ends(now, before, None)

    def _advance(self, now: float) -> float:
        stretch = self.share.stretch(len(self.work_left))
        elapsed = (now - self._since) / stretch
        if elapsed:
            for replica in self.work_left:
                self.work_left[replica] -= elapsed
        self._since = now
        return stretch

    def _ends(self, now: float, stretch_before: float, started: int | None) -> dict[int, float]:
        """The end of every step when the speed changed, else only of the one just started (if any)."""
        stretch = self.share.stretch(len(self.work_left))
        if stretch != stretch_before:
            moved = list(self.work_left)
        else:
            moved = [started] if started is not None else []
        return {replica: now + max(0.0, self.work_left[replica]) * stretch for replica in moved}
