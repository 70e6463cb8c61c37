"""Where a scheduled step is computed: at once on the engine's thread, or (async scheduling) on a device thread
that runs the forwards in order, one step ahead of the host.

With async scheduling the engine schedules and launches step N+1 before it processes step N's results, so a GPU
has the next step queued before the host learns the last one's tokens, and runs step after step while the host
processes outputs and schedules. The device thread owns the device: any other device work (a prefill-lane batch,
dropping per-request state) goes through ``run_on_device``, after the steps before it.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from inflight.engine.model_runner import LaunchedStep, ModelRunner, RunnerOutput
    from inflight.engine.request import Request
    from inflight.engine.sampler import SamplingBatch
    from inflight.engine.scheduler_output import SchedulerOutput


@dataclass
class Launched:
    """A scheduled step being computed: its batch, its rows' requests, and its (result, seconds) once known:
    ``outcome`` when it was computed at once, ``future`` when it runs on the device thread (which sets it when it
    collects the step)."""

    batch: SchedulerOutput
    rows: list[Request]
    future: Future | None
    outcome: tuple[RunnerOutput, float] | None = None

    def result(self) -> tuple[RunnerOutput, float]:
        return self.outcome if self.future is None else self.future.result()


class StepLauncher:
    def __init__(self, runner: ModelRunner, on_device_thread: bool) -> None:
        self.runner = runner
        self._device = ThreadPoolExecutor(1, thread_name_prefix="inflight-device") if on_device_thread else None
        # The device thread's own: the step it launched and has not collected yet, with the future it answers.
        self._uncollected: tuple[LaunchedStep, Future] | None = None

    @property
    def on_device_thread(self) -> bool:
        return self._device is not None

    def launch(self, batch: SchedulerOutput, rows: list[Request], sampling: SamplingBatch) -> Launched:
        """Start computing ``batch``: at once (the launch holds its outcome), or on the device thread."""
        if self._device is None:
            started = time.perf_counter()
            result = self.runner.execute(batch, sampling)
            return Launched(batch, rows, None, (result, time.perf_counter() - started))
        future: Future = Future()
        self._device.submit(self._launch_on_device, batch, sampling, future)
        return Launched(batch, rows, future)

    def collect_soon(self) -> None:
        """Have the device thread hand over the step it holds (no later launch will)."""
        self._device.submit(self._collect_on_device)

    def run_on_device(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` where the device's work runs, after the steps before it; its result."""
        if self._device is None:
            return fn(*args)
        return self._device.submit(fn, *args).result()

    def _launch_on_device(self, batch: SchedulerOutput, sampling: SamplingBatch, done: Future) -> None:
        """The device thread's part of a step: launch it, then collect the step before it, which the device was
        computing meanwhile (no gap for the host's work, nor for this thread's wait for the GIL, up to the
        interpreter's switch interval, 5 ms, while the host thread runs Python). A step already computed (always,
        on a CPU, where launching computes it) is handed over at once: nothing is gained by holding it."""
        uncollected = self._uncollected
        if uncollected is not None and uncollected[0].done():
            self._collect_on_device()
        try:
            step = self.runner.launch(batch, sampling)
        except BaseException as error:  # the step before is still owed its result
            self._collect_on_device()
            done.set_exception(error)
            return
        self._collect_on_device()
        self._uncollected = (step, done)
        if step.done():
            self._collect_on_device()

    def _collect_on_device(self) -> None:
        """Hand the uncollected step's (result, device seconds) to its future; nothing when there is none."""
        if self._uncollected is None:
            return
        (step, done), self._uncollected = self._uncollected, None
        try:
            result = self.runner.collect(step)
        except BaseException as error:
            done.set_exception(error)
            return
        done.set_result((result, self.runner.device_seconds(step)))
