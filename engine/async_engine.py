"""The engine for servers: the step loop runs in a worker thread, off the event loop.

Only the loop task touches the engine's queue, between steps: ``generate`` validates on the
caller's side, then hands prepared requests (and aborts) to the loop task, which applies them
before the next step. Each request's outputs flow back through its own ``asyncio.Queue``.
"""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

from engine.llm_engine import LLMEngine, PromptInput
from engine.outputs import RequestOutput
from engine.request import Request
from engine.sampling_params import SamplingParams


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
        finished = False
        try:
            while True:
                item = await queue.get()
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
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
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
