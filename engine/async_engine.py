"""The engine for servers: the step loop runs in a worker thread, off the event loop.

Only the loop task touches the engine's queue, between steps: ``generate`` validates on the
caller's side, then hands prepared requests (and aborts) to the loop task, which applies them
before the next step. Each request's outputs flow back through its own ``asyncio.Queue``.
"""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import ThreadPoolExecutor
import time
from typing import Any, AsyncIterator, Callable

from engine.llm_engine import LLMEngine, PromptInput
from engine.outputs import RequestOutput
from engine.request import Request
from engine.sampling_params import SamplingParams


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
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inflight-step")
        self._queues: dict[str, asyncio.Queue] = {}
        self._pending_adds: list[list[Request]] = []
        self._pending_aborts: list[str] = []
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._dead: BaseException | None = None
        self._ids = itertools.count()
        # Called after every step with (seconds, rows in the batch); the server hangs metrics here.
        self.step_observer: Callable[[float, int], None] | None = None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    async def generate(self, prompt: PromptInput, params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield this request's outputs step by step; the last one has ``finished=True``.

        Leaving the iteration early (or cancelling the task) aborts the request, freeing its KV blocks.
        A consumer that falls behind gets one output carrying everything since its last one (the
        ``new_*`` fields joined), so a slow client costs one message per read, not one per token.
        """
        async for output in self.submit(prompt, params, request_id, priority):
            yield output

    def submit(self, prompt: PromptInput, params: SamplingParams | None = None, request_id: str | None = None,
               priority: int = 0) -> "RequestStream":
        """Validate and queue now (a bad request raises ``ValueError`` here), stream the outputs later.

        Iterate the returned stream to the end, or leave it early to abort the request.
        """
        self.check_health()
        self._ensure_loop()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use")
        requests = self.engine.make_requests(request_id, prompt, params, priority)  # raises ValueError
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._pending_adds.append(requests)
        self._wakeup.set()
        return RequestStream(request_id, requests[0].prompt_token_ids, self._stream(request_id, queue))

    async def _stream(self, request_id: str, queue: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await queue.get()
                while not queue.empty() and isinstance(item, RequestOutput) and not item.finished:
                    nxt = queue.get_nowait()
                    item = _merge(item, nxt) if isinstance(nxt, RequestOutput) else nxt
                if isinstance(item, ValueError):
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
                self._pending_aborts.append(request_id)
                if self._wakeup is not None:
                    self._wakeup.set()

    async def abort(self, request_id: str) -> None:
        self._pending_aborts.append(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine step loop died: {self._dead!r}")
        if self._loop_task is not None and self._loop_task.done():
            raise EngineDeadError("engine step loop has stopped")

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass  # a loop that died already reported it to its requests and to check_health
        self._executor.shutdown(wait=True)

    # -- the loop task ------------------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._loop_task is None:
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _apply_pending(self) -> None:
        adds, self._pending_adds = self._pending_adds, []
        for requests in adds:
            parent = requests[0].parent_id
            if parent not in self._queues:
                continue  # cancelled before it was queued
            try:
                self.engine.enqueue(requests)
            except ValueError as e:
                self._queues[parent].put_nowait(e)
        aborts, self._pending_aborts = self._pending_aborts, []
        for request_id in aborts:
            self.engine.abort_request(request_id)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._apply_pending()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.clear()
                    if not self._pending_adds and not self._pending_aborts:
                        await self._wakeup.wait()
                    continue
                started = time.perf_counter()
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
                if self.step_observer is not None:
                    self.step_observer(time.perf_counter() - started, self.engine.last_batch_size)
                for output in outputs:
                    queue = self._queues.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the loop is dead: fail every waiter rather than hang it
            self._dead = e
            for queue in self._queues.values():
                queue.put_nowait(e)
            raise


def _merge(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """``newer`` with the per-step deltas of ``older`` prepended (both of the same request)."""
    for old, new in zip(older.outputs, newer.outputs):
        new.new_token_ids = old.new_token_ids + new.new_token_ids
        new.new_text = old.new_text + new.new_text
    return newer
