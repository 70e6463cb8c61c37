"""The engine for servers: the step loop runs in its own thread, off the event loop.

The step thread owns the engine: it applies queued requests and aborts between steps, runs steps
back to back while there is work, and hands each step's outputs to the event loop in one
``call_soon_threadsafe``. So a busy event loop (a server relaying thousands of messages) never
delays the next step, and the engine's state is only ever touched by one thread. ``submit``
validates on the caller's side; each request's outputs flow back through its own ``asyncio.Queue``.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import Any, AsyncIterator, Callable

from engine.llm_engine import LLMEngine, PromptInput
from engine.outputs import DeadlineUnmeetableError, RequestOutput
from engine.request import Request
from engine.sampling_params import PoolingParams, SamplingParams

IDLE_WAIT_S = 0.5  # how often an idle step thread looks up (it is woken at once by new work)
STATS_PERIOD_S = 0.05  # how fresh stats() is while steps run (it walks the queues, so not every step)


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
    def __init__(self, model: str = "demo-tiny", *, engine: LLMEngine | None = None, **engine_args: Any) -> None:
        self.engine = engine if engine is not None else LLMEngine(model, **engine_args)
        self._queues: dict[str, asyncio.Queue] = {}  # event-loop side only
        self._lock = threading.Lock()  # guards the two pending lists, shared with the step thread
        self._pending_adds: list[list[Request]] = []
        self._pending_aborts: list[str] = []
        self._work = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: BaseException | None = None
        self._stats = self.engine.stats()  # the step thread's latest snapshot
        self._queue_view: QueueView | None = None  # and its latest view of the queue, for admission
        self._ids = itertools.count()
        # Called from the step thread after every step with (seconds, rows in the batch): metrics hang here.
        self.step_observer: Callable[[float, int], None] | None = None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

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
               request_id: str | None = None, priority: int = 0) -> "RequestStream":
        """Validate and queue now (a bad request raises ``ValueError`` here), stream the outputs later.

        Iterate the returned stream to the end, or leave it early to abort the request.
        """
        self.check_health()
        self._ensure_thread()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use")
        requests = self.engine.make_requests(request_id, prompt, params, priority)  # raises ValueError
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            self._check_deadline_now(requests)
        except DeadlineUnmeetableError as e:  # refused on the stream, like a refusal from the step thread
            queue.put_nowait(e)
        else:
            with self._lock:
                self._pending_adds.append(requests)
            self._work.set()
        return RequestStream(request_id, requests[0].prompt_token_ids, self._stream(request_id, queue))

    def _check_deadline_now(self, requests: list[Request]) -> None:
        """Refuse an unmeetable deadline here, from the step thread's latest view of the queue, instead of when
        the step under way ends and the engine admits the request: a long prefill step can outlast a short
        deadline. The engine checks again, from its live queue, when it admits the request."""
        first, view = requests[0], self._queue_view
        if view is None or first.deadline is None or not first.params.reject_unmeetable_deadline \
                or not self.engine.predicts_for(first):
            return
        with self._lock:  # submitted since the view and not yet admitted: they are queued ahead too
            pending = [(view.newcomer_rank(r.priority, r.arrival_order), r.num_tokens)
                       for siblings in self._pending_adds for r in siblings]
        self.engine.check_deadline(requests, view, time.time(), pending)

    async def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await queue.get()
                while not queue.empty() and isinstance(item, RequestOutput) and not item.finished:
                    nxt = queue.get_nowait()
                    item = _merge(item, nxt) if isinstance(nxt, RequestOutput) else nxt
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
        with self._lock:
            self._pending_aborts.append(request_id)
        self._work.set()

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine step loop died: {self._dead!r}")
        if self._thread is not None and not self._thread.is_alive() and not self._stopping:
            raise EngineDeadError("engine step loop has stopped")

    def stats(self) -> dict[str, Any]:
        """The engine's state after its latest step (or after it last applied new work while idle)."""
        return dict(self._stats)

    async def shutdown(self) -> None:
        self._stopping = True
        self._work.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)

    # -- the step thread ---------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._run, name="inflight-step", daemon=True)
            self._thread.start()

    def _apply_pending(self) -> None:
        refused = []
        # Under the lock until the new view is published: a submit in between would see neither the requests
        # in the view nor in the pending list, and under-count the queue ahead of it.
        with self._lock:
            adds, self._pending_adds = self._pending_adds, []
            aborts, self._pending_aborts = self._pending_aborts, []
            for requests in adds:
                try:
                    self.engine.enqueue(requests)
                except (ValueError, DeadlineUnmeetableError) as e:
                    refused.append((requests[0].parent_id, e))
            if adds:
                self._queue_view = self.engine.queue_view()
        for request_id in aborts:
            self.engine.abort_request(request_id)
        if refused:
            self._loop.call_soon_threadsafe(self._deliver_errors, refused)

    def _run(self) -> None:
        stats_time = 0.0
        try:
            while not self._stopping:
                self._apply_pending()
                if not self.engine.has_unfinished_requests():
                    self._stats, self._queue_view = self.engine.stats(), self.engine.queue_view()
                    self._work.wait(IDLE_WAIT_S)
                    self._work.clear()
                    continue
                started = time.perf_counter()
                outputs = self.engine.step()
                finished = time.perf_counter()
                # Fresh at least every period, and before the outputs that leave the engine idle are
                # delivered: whoever awaited the last result must not read stats from before it.
                if finished - stats_time >= STATS_PERIOD_S or not self.engine.has_unfinished_requests():
                    self._stats, stats_time = self.engine.stats(), finished
                    self._queue_view = self.engine.queue_view()
                if self.step_observer is not None:
                    self.step_observer(finished - started, self.engine.last_batch_size)
                if outputs:
                    self._loop.call_soon_threadsafe(self._deliver, outputs)
        except BaseException as e:  # the loop is dead: fail every waiter rather than hang it
            self._dead = e
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail_all, e)

    # -- on the event loop -----------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)

    def _deliver_errors(self, refused: list[tuple[str, Exception]]) -> None:
        for request_id, error in refused:
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(error)

    def _fail_all(self, error: BaseException) -> None:
        for queue in self._queues.values():
            queue.put_nowait(error)


def _merge(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """``newer`` with the per-step deltas of ``older`` prepended (both of the same request)."""
    for old, new in zip(older.outputs, newer.outputs):
        new.new_token_ids = old.new_token_ids + new.new_token_ids
        new.new_text = old.new_text + new.new_text
    return newer
