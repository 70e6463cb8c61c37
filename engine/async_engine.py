"""The engine for servers: the step loop runs off the event loop, on its own thread or in its own process.

The step loop (``engine_core.run_step_loop``) owns the engine: it takes in queued requests and aborts
between steps, runs the core's steps back to back while there is work, and reports each step's records (new
token ids, ends), which reach the event loop in one ``call_soon_threadsafe``. There the front end
(``OutputProcessor``) detokenizes, finds stop strings (and tells the core) and makes the outputs. So a busy event
loop (a server relaying thousands of messages) never delays the next step, the engine's state is only ever
touched by one thread, and the step loop never detokenizes. ``submit`` validates on the caller's side; each
request's outputs flow back through its own ``asyncio.Queue``.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from inflight.engine.cpu_list import parse_cpu_list
from inflight.engine.core_messages import AbortRequest, AddRequests, FinishStopped, Record, Refusal, StepReport, StopLoop
from inflight.engine.engine_core import EngineCoreProcess, StepThread
from inflight.engine.models.packaged import DEFAULT_MODEL
from inflight.engine.models.source import read_model_source
from inflight.engine.output_processor import OutputProcessor
from inflight.engine.outputs import DeadlineUnmeetableError, RequestOutput
from inflight.engine.request import Continuation, Request
from inflight.engine.request_maker import PromptInput, RequestMaker
from inflight.engine.sampling_params import PoolingParams, SamplingParams
from inflight.engine.ttft_predictor import QueueView, check_deadline, predicts_for

if TYPE_CHECKING:
    from inflight.engine.llm_engine import LLMEngine


class RequestStream:
    """A queued request: its id, its prompt's token ids, and the async iterator of its outputs."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], outputs: AsyncIterator[RequestOutput]) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self._outputs = outputs

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs

    async def aclose(self) -> None:
        await self._outputs.aclose()


class EngineDeadError(RuntimeError):
    """The step loop died; every in-flight request fails with this, and health checks raise it."""


class AsyncLLMEngine:
    """``engine_process=False`` (the default): the step loop on a thread of this process. ``True``: in a child
    process of its own (``engine_core.EngineCoreProcess``), which servers use so that their event loop and
    the engine's steps never wait for each other's GIL; ``engine`` is then None (the engine lives there).
    ``engine_cpus`` ("0", "0-3", "0,2"): the CPUs that process runs on, for an engine with cores of its own
    (``serve_app.cpu_plan`` keeps the serving processes off them).

    ``max_outputs_per_s``: about how many outputs per second the streams get in all. Each stream's come at most
    every (streams producing / ``max_outputs_per_s``) seconds, its first and its last at once; the tokens of the
    steps between gather into the next (``OutputProcessor.process``). A server that relays every output as a message
    (``serve_app.replica``) so spends its event loop per interval, not per step and stream. None: an output per
    step that gave a stream something."""

    def __init__(self, model: str = DEFAULT_MODEL, *, engine: LLMEngine | None = None, engine_process: bool = False,
                 engine_cpus: str | None = None, max_outputs_per_s: float | None = None, **engine_args: Any) -> None:
        self._queues: dict[str, asyncio.Queue] = {}  # event-loop side only
        self._lock = threading.Lock()  # guards the view and the adds it does not hold yet (the reporting thread)
        self._queue_view: QueueView | None = None  # the engine's latest view of its queue, for admission
        self._unapplied: dict[int, list[Request]] = {}  # add commands sent, by sequence number, not in the view yet
        self._seq = 0
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: BaseException | None = None
        self._ids = itertools.count()
        if max_outputs_per_s is not None and not max_outputs_per_s > 0:
            raise ValueError(f"max_outputs_per_s must be > 0 or None, got {max_outputs_per_s!r}")
        self.max_outputs_per_s = max_outputs_per_s
        # Called after every step with (seconds, rows in the batch), on the thread that reports: metrics hang here.
        self.step_observer: Callable[[float, int], None] | None = None
        # Called once, on the thread that found it, if the engine dies while not being shut down (its process
        # killed or crashed, its step loop raised): after every waiting stream was handed the error.
        self.death_observer: Callable[[BaseException], None] | None = None
        if engine_cpus and not engine_process:
            raise ValueError("engine_cpus needs engine_process=True (the CPUs are the engine process's)")
        if engine_process:
            if engine is not None:
                raise ValueError("engine_process: an engine object cannot be moved into a process; pass its arguments")
            self.engine: LLMEngine | None = None
            source = read_model_source(model)  # its tokenizer and vocabulary, here too: the replica admits requests
            self._core = EngineCoreProcess(model, engine_args, self._on_report, self._on_death,
                                           parse_cpu_list(engine_cpus) if engine_cpus else None)
            info = self._core.info  # what only the engine knows: the pool it sized, max_model_len to fit it
            self.tokenizer = source.tokenizer
            self.config, self.max_model_len, self._stats = info.config, info.max_model_len, info.stats
            self._maker = RequestMaker(self.tokenizer, source.config.vocab_size, source.eos_token_ids,
                                       self.max_model_len, info.max_model_len_note)
        else:
            if engine is None:
                from inflight.engine.llm_engine import LLMEngine  # here: with the engine in its own process, this one needs no torch

                engine = LLMEngine(model, **engine_args)
            self.engine = engine
            self.tokenizer, self.config, self.max_model_len = (self.engine.tokenizer, self.engine.config,
                                                               self.engine.max_model_len)
            self._stats = self.engine.stats()
            self._maker = self.engine.request_maker
            self._core = StepThread(self.engine, self._on_report, self._on_death)
        self._front_end = OutputProcessor(self.tokenizer)  # event-loop side only

    async def generate(self, prompt: PromptInput, params: SamplingParams | PoolingParams | None = None,
                       request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield this request's outputs step by step; the last one has ``finished=True``. A request that
        generates nothing (prompt scoring with ``max_tokens=0``, an embedding with ``PoolingParams``) yields
        one output, the final one.

        Leaving the iteration early (or cancelling the task) aborts the request, freeing its KV blocks.
        A consumer that falls behind gets one output carrying everything since its last one (the
        ``new_*`` fields joined), so a slow client costs one message per read, not one per token.
        """
        async for output in self.submit(prompt, params, request_id, priority):
            yield output

    def submit(self, prompt: PromptInput, params: SamplingParams | PoolingParams | None = None,
               request_id: str | None = None, priority: int = 0,
               continuations: dict[int, Continuation] | None = None) -> "RequestStream":
        """Validate and queue now (a bad request raises ``ValueError`` here), stream the outputs later.

        Iterate the returned stream to the end, or leave it early to abort the request. ``continuations``:
        continue a request that ran elsewhere (``engine.request.Continuation``, by choice index).
        """
        self.check_health()
        self._loop = asyncio.get_running_loop()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use")
        requests = self._maker.make_requests(request_id, prompt, params, priority,  # raises ValueError
                                             continuations=continuations)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            self._check_deadline_now(requests)
        except DeadlineUnmeetableError as e:  # refused on the stream, like a refusal from the engine
            queue.put_nowait(e)
        else:
            self._front_end.add(requests)
            with self._lock:  # recorded before it is sent, so the report that takes it in finds it
                self._seq = seq = self._seq + 1
                self._unapplied[seq] = requests
            # Outside the lock: a send can wait while the engine process is mid-step, and the reader thread needs
            # the lock to hand over that step's report (holding it here could leave both waiting on each other).
            self._core.send(AddRequests(seq, requests))
        delta = requests[0].params.output_kind == "delta"
        return RequestStream(request_id, requests[0].prompt_token_ids, self._stream(request_id, queue, delta))

    async def check_structured_output(self, params: SamplingParams | PoolingParams | None, timeout_s: float) -> None:
        """Compile ``params``' structured output on a thread, within ``timeout_s`` (else ``ValueError``), before
        ``submit``: a schema that takes long to compile must not hold this event loop, nor pass unbounded.
        ``submit`` then finds it compiled. (A compile that overran goes on in its thread; its result is cached.)"""
        constraint = getattr(params, "structured_output", None)
        if constraint is None:
            return
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.run_in_executor(None, self._maker.check_structured_output, constraint),
                                   timeout_s)
        except asyncio.TimeoutError:
            raise ValueError(f"structured_outputs: the {constraint.kind} took longer than {timeout_s:g} s to "
                             f"compile") from None

    def _check_deadline_now(self, requests: list[Request]) -> None:
        """Refuse an unmeetable deadline here, from the engine's latest view of its queue plus what was sent
        since, instead of when the step under way ends and the engine takes the request in: a long prefill step
        can outlast a short deadline. The engine checks again, from its live queue, when it takes it in."""
        first = requests[0]
        if first.deadline is None or not first.params.reject_unmeetable_deadline or not predicts_for(self.config, first):
            return
        with self._lock:
            view = self._queue_view
            if view is None:
                return
            pending = [(view.newcomer_rank(r.priority, r.arrival_order), r.num_tokens)
                       for siblings in self._unapplied.values() for r in siblings]
        check_deadline(requests, view, time.time(), pending)

    async def _stream(self, request_id: str, queue: asyncio.Queue, delta: bool) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await queue.get()
                while not queue.empty() and isinstance(item, RequestOutput) and not item.finished:
                    nxt = queue.get_nowait()
                    item = _merge(item, nxt, delta) if isinstance(nxt, RequestOutput) else nxt
                if isinstance(item, (ValueError, DeadlineUnmeetableError)):
                    raise item  # the request was refused; the engine is fine
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"engine step loop died: {item!r}") from item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._abort_soon(request_id)

    async def abort(self, request_id: str) -> None:
        self._abort_soon(request_id)

    def _abort_soon(self, request_id: str) -> None:
        if self._dead is None and not self._stopping:
            self._core.send(AbortRequest(request_id))

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine step loop died: {self._dead!r}")
        if not self._stopping and not self._core.alive():
            raise EngineDeadError("engine step loop has stopped")

    def stats(self) -> dict[str, Any]:
        """The engine's state after its latest step (or after it last took in new work while idle)."""
        return dict(self._stats)

    async def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        if self._dead is None:
            try:
                self._core.send(StopLoop())
            except OSError:  # the process has gone already
                pass
        await asyncio.get_running_loop().run_in_executor(None, self._core.join, 10.0)

    # -- on the thread that reports (the step thread, or the engine process's reader) ----------------------
    def _on_report(self, report: StepReport) -> None:
        if report.stats is not None:
            self._stats = report.stats
            with self._lock:
                self._queue_view = report.view
                for seq in [s for s in self._unapplied if s <= report.applied_seq]:
                    del self._unapplied[seq]
        if report.seconds is not None and self.step_observer is not None:
            self.step_observer(report.seconds, report.batch_size)
        if report.records:
            self._loop.call_soon_threadsafe(self._deliver, report.records)
        if report.refused:
            self._loop.call_soon_threadsafe(self._deliver_errors, report.refused)

    def _on_death(self, error: BaseException) -> None:
        self._dead = error
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._fail_all, error)
        if self.death_observer is not None and not self._stopping:
            self.death_observer(error)

    # -- on the event loop -----------------------------------------------------------------------
    def _deliver(self, records: list[Record]) -> None:
        outputs, stopped = self._front_end.process(records, time.monotonic(), self.max_outputs_per_s)
        if self._dead is None and not self._stopping:
            for request_id, stop in stopped:  # the core ends it between its next steps
                self._core.send(FinishStopped(request_id, stop))
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)

    def _deliver_errors(self, refused: list[Refusal]) -> None:
        for refusal in refused:
            self._front_end.forget(refusal.request_id)
            queue = self._queues.get(refusal.request_id)
            if queue is not None:
                queue.put_nowait(refusal.error)

    def _fail_all(self, error: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(error)


def _merge(older: RequestOutput, newer: RequestOutput, delta: bool) -> RequestOutput:
    """One output for two queued ones of the same request: ``newer`` with what ``older`` added prepended (for
    ``delta`` outputs, everything ``older`` carried: its tokens, text and logprobs, and the prompt's fields)."""
    for old, new in zip(older.outputs, newer.outputs):
        if delta:
            new.token_ids = new.new_token_ids = old.token_ids + new.token_ids
            new.text = new.new_text = old.text + new.text
            if new.logprobs is not None:
                new.logprobs = old.logprobs + new.logprobs
        else:
            new.new_token_ids = old.new_token_ids + new.new_token_ids
            new.new_text = old.new_text + new.new_text
    if delta and newer.prompt_token_ids is None:
        newer.prompt_token_ids, newer.prompt_logprobs = older.prompt_token_ids, older.prompt_logprobs
    return newer
