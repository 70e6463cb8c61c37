"""Small shared helpers for the engine tests: engines, schedulers, requests and bounded step loops."""

from __future__ import annotations

import random
import threading
import time as _time
from typing import Any

from inflight.engine import LLM, AsyncLLMEngine, LLMEngine, SamplingParams
from inflight.engine.config import EngineConfig
from inflight.engine.request import Request
from inflight.engine.scheduler import Scheduler, make_scheduler as _make_scheduler

EOS_ID = 2  # demo-tiny's and the test checkpoints' eos
FIRST_BYTE_ID = 7  # ids below this are special tokens in the byte-level vocabulary
VOCAB_SIZE = 263

# Small KV pool and batch by default: tests never rely on the CPU default of 1 GiB of KV. float32 everywhere: the
# test checkpoints and transformers' reference are float32, and on a GPU dtype auto would run them in bfloat16.
# kv_headroom_tokens=0: admit while the next chunk fits, so that the small pools these tests size to force
# preemption do force it (admission with headroom avoids most preemptions: test_scheduler.py tests that).
ENGINE_DEFAULTS: dict[str, Any] = dict(block_size=4, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=64,
                                       dtype="float32", kv_headroom_tokens=0)


def make_engine(model: str = "demo-tiny", **overrides: Any) -> LLMEngine:
    return LLMEngine(str(model), **{**ENGINE_DEFAULTS, **overrides})


def make_llm(model: str = "demo-tiny", **overrides: Any) -> LLM:
    return LLM(str(model), **{**ENGINE_DEFAULTS, **overrides})


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, **kwargs)


def random_prompts(num: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """Prompts of byte tokens (no special tokens), lengths in [min_len, max_len]."""
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_BYTE_ID, VOCAB_SIZE) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(num)]


def run_engine(engine: LLMEngine, max_steps: int = 2000) -> dict[str, Any]:
    """Step until no request is left; returns the final output of each request id. Never loops forever."""
    finished = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finished
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    raise AssertionError(f"engine still has unfinished requests after {max_steps} steps: {engine.stats()}")


def generate_ids(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams,
                 max_steps: int = 2000) -> list[list[int]]:
    """Add every prompt, run to completion, return the token ids of each (first sequence), in input order."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    outputs = run_engine(engine, max_steps)
    return [outputs[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]


# -- scheduler-level helpers --------------------------------------------------------------------------

def make_config(**overrides: Any) -> EngineConfig:
    values = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=16, kv_headroom_tokens=0)  # (ENGINE_DEFAULTS)
    values.update(overrides)
    return EngineConfig.from_kwargs(**values)


def make_scheduler(num_kv_blocks: int = 64, window: tuple[int, int] | None = None, **overrides: Any) -> Scheduler:
    """``window``: (sliding window, window blocks): the window layers' KV kept apart (engine/block_pool.py)."""
    return _make_scheduler(make_config(**overrides), num_kv_blocks, window)


def make_request(request_id: str, prompt_len: int, max_tokens: int = 8, max_model_len: int = 4096,
                 arrival_time: float | None = None, **params: Any) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, **params)
    return Request(request_id, list(range(FIRST_BYTE_ID, FIRST_BYTE_ID + prompt_len)), sp,
                   max_model_len=max_model_len, eos_token_ids=frozenset({EOS_ID}), arrival_time=arrival_time)


def make_requests(prompt_lens: list[int], max_tokens: int | list[int] = 8, prefix: str = "r",
                  **params: Any) -> list[Request]:
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompt_lens)
    return [make_request(f"{prefix}{i}", n, m, **params) for i, (n, m) in enumerate(zip(prompt_lens, max_tokens))]


def fake_step(scheduler: Scheduler, token_id: int | dict[str, int] = 100):
    """One step with a fake runner: schedule, then give every sampling row ``token_id`` (or a per-id choice).

    Returns (the SchedulerOutput, the requests that got a token).
    """
    out = scheduler.schedule()
    tokens = []
    for rid, sample in zip(out.request_ids, out.sample):
        if not sample:
            tokens.append(None)
        elif isinstance(token_id, dict):
            tokens.append(token_id.get(rid, 100))
        else:
            tokens.append(token_id)
    advanced = scheduler.update(tokens) if not out.is_empty else []
    return out, advanced


async def assert_engine_dead(aengine, stream) -> None:
    """After the step loop died (thread or process): the open stream, the health check and a new request
    all raise ``EngineDeadError``."""
    import pytest

    from inflight.engine import EngineDeadError

    with pytest.raises(EngineDeadError):
        async for _ in stream:
            pass
    with pytest.raises(EngineDeadError):
        aengine.check_health()
    with pytest.raises(EngineDeadError):
        aengine.submit([10, 11], greedy(2))  # new requests fail fast too


def launch_ahead(monkeypatch, runner) -> list[int]:
    """Make the device thread work as on a GPU, where a launched step is still computing when the next one is
    launched: no step counts as done until it is collected, so each step is launched before the one before it is
    collected, and its placeholder rows take their tokens from that step's token tensor (on a CPU a step is
    computed by its launch, and is handed over at once). Returns a list that counts those launches."""
    from inflight.engine.model_runner import LaunchedStep

    monkeypatch.setattr(LaunchedStep, "done", lambda step: step.tokens is None)
    ahead: list[int] = []
    launch = runner.launch

    def counting_launch(batch, sampling):
        last = runner._last_launched
        if batch.placeholder_rows and last is not None and last.tokens is not None:
            ahead.append(len(batch.placeholder_rows))
        return launch(batch, sampling)

    runner.launch = counting_launch
    return ahead


# -- a clock the test moves ----------------------------------------------------------------------------

class HandClock:
    """A stand-in for a module's ``time``: ``time()`` and ``monotonic()`` move only when the test moves them
    (``advance``); the other clocks are the real ones. ``hand_clock`` puts one in place of the engine's."""

    def __init__(self, start: float) -> None:
        self.now = start

    def time(self) -> float:
        return self.now

    monotonic = time

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def __getattr__(self, name: str) -> Any:
        return getattr(_time, name)


def hand_clock(monkeypatch) -> HandClock:
    """The engine's wall clock, moved by the test: a request's arrival, the scheduler's deadlines and aging, the
    queue views admission predicts from and its ``now`` (and the async engine's pacing clock). How long the
    machine really takes between two steps, or between a view and a request, then decides nothing."""
    from inflight.engine import async_engine, llm_engine, request, scheduler_state

    clock = HandClock(_time.time())
    # (a scheduler reads scheduler_state's clock, which it takes when made: make it after this)
    for module in (request, scheduler_state, llm_engine, async_engine):
        monkeypatch.setattr(module, "time", clock)
    return clock


# -- an async engine whose streams never fall behind ----------------------------------------------------

class LockstepEngine(AsyncLLMEngine):
    """An ``AsyncLLMEngine`` that hands a step's outputs to its streams only once every stream has taken the
    outputs before them: a consumer never falls behind, whatever the machine's speed.

    Without it, a consumer that lags (on a busy machine the event loop waits for a core while the engine steps
    on) finds several steps' outputs queued and gets them merged into one (``AsyncLLMEngine._stream``), so how many
    outputs a stream gets, and which of them first carries text, depend on timing. Here a stream gets exactly the
    outputs the front end made: one per step that gave it something, fewer where pacing held some back. The thread
    that reports waits for the consumers before the next step (at most ``wait_s``: a stream nobody reads must not
    hang the engine), so the outputs are made at the time of the step that made them."""

    wait_s = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._taken = threading.Event()  # every output handed over so far has been taken
        self._taken.set()
        super().__init__(*args, **kwargs)

    def _on_report(self, report) -> None:  # on the thread that reports (the step thread, or the process's reader)
        if not report.records:
            super()._on_report(report)
            return
        # Handed over, then waited for: the next step (and anything it does to a test's clock) comes only after the
        # event loop has delivered these outputs and their streams have taken them.
        self._taken.clear()
        super()._on_report(report)
        self._taken.wait(self.wait_s)

    def _deliver(self, records) -> None:  # on the event loop
        super()._deliver(records)
        self._set_when_taken()

    def _set_when_taken(self) -> None:
        if any(queue.qsize() for queue in self._queues.values()):
            self._loop.call_soon(self._set_when_taken)  # again once the consumers it woke have run
        else:
            self._taken.set()

    async def shutdown(self) -> None:
        self._taken.set()
        await super().shutdown()
