"""Request-level batching, as systems before paging did it: the comparison continuous batching is measured against.

A batch forms in arrival order (up to ``max_num_seqs``) only once KV for prompt + max_tokens of every member is
reserved. All members prefill, then decode in lockstep until the longest one ends; members that end early keep
their slot and are computed as padding (``Request.static_padding``): their last position is recomputed against the
cached context, nothing is kept, exactly the waste static batching pays. Nobody joins a running batch. Blocks are
returned when the whole batch ends. No prefix caching, no persistent batch, no preemption (nothing is admitted
without its whole KV).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from inflight.engine.request import Request, RequestStatus
from inflight.engine.scheduler import Scheduler
from inflight.engine.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from inflight.engine.block_pool import KVCacheManager


class StaticScheduler(Scheduler):
    prefix_caching = False
    keeps_decode_batch = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._padding: list[Request] = []  # this step's finished members, computed after the others as padding

    def _pick(self) -> dict[Request, int]:
        """The members that still compute (the finished ones join a decode step as padding: ``_build_batch``)."""
        self._end_batch_if_done()  # (every member aborted since the last step)
        if not self.running:
            self._form_batch()
        self._padding = []
        prefilling = [r for r in self.running if not r.static_padding and r.num_tokens - r.num_computed_tokens > 1]
        if prefilling:
            budget = self.config.max_num_batched_tokens
            scheduled = {}
            for request in prefilling:
                num_new = min(request.num_tokens - request.num_computed_tokens, budget)
                if num_new == 0:
                    break
                scheduled[request] = num_new
                budget -= num_new
            return scheduled
        self._padding = [r for r in self.running if r.static_padding]
        return dict.fromkeys((r for r in self.running if not r.static_padding), 1)

    def _build_batch(self, requests: list[Request], counts: list[int]) -> SchedulerOutput:
        out = super()._build_batch(requests, counts)
        for request in self._padding:  # after the rows ``update`` reads: it zips the requests with the first rows
            _add_padding_row(out, request, self.kv)
        return out

    def _form_batch(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not self.kv.allocate(request.request_id, request.max_total_tokens):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._running_changed()

    def _release_slot(self, request: Request) -> None:
        if request.num_computed_tokens > 0:
            request.static_padding = True  # keeps slot and blocks until its batch ends
            return
        super()._release_slot(request)

    def _on_step_end(self) -> None:
        self._end_batch_if_done()

    def _end_batch_if_done(self) -> None:
        if self.running and all(r.static_padding for r in self.running):
            for request in self.running:
                self.kv.free(request.request_id)
            self.running = []
            self._running_changed()


def _add_padding_row(out: SchedulerOutput, request: Request, kv: KVCacheManager) -> None:
    """Recompute the member's last position against its cached context; its KV is not written (the runner sends
    a padding row's store to a scratch slot) and its sample is thrown away."""
    start = request.num_computed_tokens
    out.request_ids.append(request.request_id)
    out.input_token_ids.append(request.all_token_ids[start - 1])
    out.query_lens.append(1)
    out.start_positions.append(start - 1)
    out.block_tables.append(list(kv.block_tables[request.request_id]))
    if out.window_tables is not None:
        out.window_tables.append(list(kv.window_tables[request.request_id]))
    if out.long_rope is not None:
        out.long_rope.append(request.long_rope)
    out.sample.append(False)
    out.padding.append(True)
