"""The prefill-only lane: requests that generate nothing, batched statically, run without the KV cache.

Prompt scoring (``max_tokens=0`` with ``prompt_logprobs``) and embeddings (``PoolingParams``) are one
forward over a prompt and nothing after it. Through the continuous scheduler they would need a batch
slot and KV blocks like any prefill, so behind a full decode batch, or a KV cache held by decodes, they
would wait although nothing they compute is ever read again. The lane gives them a path of their own,
as TensorRT-LLM configures its context and generation phases apart: a FIFO queue, batches formed in
arrival order under their own limits (``max_prefill_batch_tokens``, ``max_prefill_batch_size``; a
prompt longer than the token limit runs alone), each batch one forward of whole prompts that attends
without any cache (``kernels/dense_prefill.py``).

Interleaving: ``LLMEngine.step`` runs the scheduler's step, then one lane batch when the lane has work.
So a lane request waits for at most the current step plus the lane batches ahead of it, never for a
slot or a block; and decodes wait for at most one lane batch per token, a bound set by
``max_prefill_batch_tokens``. (Running lane batches only when the scheduler is idle would starve them
under steady decode traffic; running the whole lane queue at once would stall decodes without bound.)
"""

from __future__ import annotations

import time
from collections import deque

from inflight.engine.outputs import FinishReason
from inflight.engine.request import Request, RequestStatus
from inflight.engine.scheduler_output import PrefillBatch, PromptRow


class PrefillLane:
    """A FIFO of prefill-only requests, taken a static batch at a time.

    Invariant: a request is in ``waiting`` from ``add`` until its batch is taken, it is aborted, or its
    deadline passes; a taken request is finished within the same engine step. Lane requests never hold
    a batch slot or a KV block.
    """

    def __init__(self, max_batch_tokens: int, max_batch_size: int) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.waiting: deque[Request] = deque()
        self._ended: list[Request] = []  # aborted or timed out since the last drain
        self._num_with_deadline = 0  # of the waiting requests
        self.num_batches = 0
        self.num_tokens = 0  # prompt tokens computed by the lane

    def add(self, request: Request) -> None:
        assert request.prefill_only, "only requests that generate nothing take the prefill lane"
        self.waiting.append(request)
        if request.deadline is not None:
            self._num_with_deadline += 1

    def has_work(self) -> bool:
        return bool(self.waiting or self._ended)

    def abort(self, request_id: str) -> bool:
        """End a queued request; False if the lane does not hold it."""
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                self._end(request, "abort")
                return True
        return False

    def next_batch(self) -> list[Request]:
        """The next batch in arrival order, within both limits; queued requests past their deadline end instead."""
        self._expire_deadlines()
        batch: list[Request] = []
        num_tokens = 0
        while self.waiting and len(batch) < self.max_batch_size:
            request = self.waiting[0]
            if batch and num_tokens + request.num_tokens > self.max_batch_tokens:
                break
            self.waiting.popleft()
            if request.deadline is not None:
                self._num_with_deadline -= 1
            request.status = RequestStatus.RUNNING
            batch.append(request)
            num_tokens += request.num_tokens
        if batch:
            now = time.time()
            for request in batch:
                request.metrics.first_scheduled_time = now
            self.num_batches += 1
            self.num_tokens += num_tokens
        return batch

    @staticmethod
    def batch_input(requests: list[Request]) -> PrefillBatch:
        """What the runner needs of a batch: whole prompts and what each hands back."""
        return PrefillBatch([r.request_id for r in requests], [r.prompt_token_ids for r in requests],
                            [PromptRow(r.params.prompt_logprobs, r.pool, None) for r in requests])

    def finish(self, request: Request) -> None:
        """The request's prompt was computed: it is done (finish reason ``length``: it reached max_tokens=0)."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = "length"
        request.metrics.finished_time = time.time()

    def drain_ended(self) -> list[Request]:
        """Requests aborted or timed out since the last call."""
        ended, self._ended = self._ended, []
        return ended

    def _expire_deadlines(self) -> None:
        if not self._num_with_deadline:
            return
        now = time.time()
        for request in [r for r in self.waiting if r.deadline is not None and r.deadline <= now]:
            self.waiting.remove(request)
            self._end(request, "timeout")

    def _end(self, request: Request, reason: FinishReason) -> None:
        """End a request that is no longer queued."""
        if request.deadline is not None:
            self._num_with_deadline -= 1
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.metrics.finished_time = time.time()
        self._ended.append(request)
