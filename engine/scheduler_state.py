"""The requests a scheduler holds: the waiting queue, the running set and their KV blocks, and what ended since the
engine last looked. ``Scheduler`` (scheduler.py) builds on it and decides who runs each step.

Invariant: a request is in exactly one of ``waiting`` (in arrival order; preempted requests go back to their
arrival position), ``running`` (holds a batch slot and KV blocks) or neither (finished, blocks already freed, except
in static mode, where finished members keep their blocks until the batch ends: ``StaticScheduler``).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from inflight.engine.block_pool import KVCacheManager, KVCacheStats
from inflight.engine.config import EngineConfig
from inflight.engine.outputs import FinishReason
from inflight.engine.persistent_batch import KeptDecodeBatch, PersistentBatch
from inflight.engine.preemption import Preemption
from inflight.engine.request import Request, RequestStatus
from inflight.engine.scheduling_policy import Rank, SchedulingPolicy


class SchedulerState:
    prefix_caching = True  # a subclass that cannot reuse cached prefixes turns it off
    keeps_decode_batch = True  # ... or keep a persistent decode batch

    def __init__(self, config: EngineConfig, num_kv_blocks: int, window: tuple[int, int] | None = None) -> None:
        """``window``: (the model's sliding window, blocks of the window caches) where its windowed layers' KV is
        kept apart (block_pool.py)."""
        self.config = config
        self.kv = KVCacheManager(num_kv_blocks, config.block_size,
                                 enable_prefix_caching=self.prefix_caching and config.enable_prefix_caching,
                                 **(dict(window=window[0], num_window_blocks=window[1]) if window else {}))
        self.policy = SchedulingPolicy(config)
        self.preemption = Preemption(config.preemption_mode)
        # A LongRoPE model's original length (set by the engine): a sequence longer than it is rotated long
        # throughout: from its admission (``add``), or recomputed once it grows past it (``Scheduler._pick``);
        # batches say which rows are (engine/models/rope.py)
        self.long_rope_length: int | None = None
        # What "now" is to deadlines, aging and request metrics: the wall clock, or a simulator's virtual one
        # (serve_app/sim/), so the same rules decide there.
        self.clock: Callable[[], float] = time.time
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Scheduled steps whose results have not been applied (update), oldest first: each step's requests and the
        # KV length each reaches (parallel lists: no tuple per row per step), its proposed tokens by row
        # (SchedulerOutput.spec_token_ids), and the persistent batch that scheduled it, if one did. One step in the
        # synchronous loop; two while the engine schedules a step before the previous one's tokens are back.
        self._in_flight: deque[tuple[list[Request], list[int], dict[int, list[int]], PersistentBatch | None]] = deque()
        # While the running set stays what it was when the general path last scheduled a batch of decodes over all
        # of it, decode steps may run from a persistent batch (persistent_batch.py). ``_running_changes`` counts
        # changes to the running set; the batch is dropped at each.
        self.kept = KeptDecodeBatch(self.keeps_decode_batch and config.persistent_batch)
        self._running_changes = 0
        self._num_with_deadline = 0
        self._num_with_prompt_work = 0  # requests here with Request.has_prompt_work (prompt outputs, or no generation)
        # aborted, timed out, or prefill-only and done (they end without producing a token) since the last drain
        self._ended_without_token: list[Request] = []
        self._ended_with_state: list[str] = []  # ended, with state in the runner to drop (SchedulerOutput.ended_ids)

    # -- queue -----------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        # Even alone in the pool the request must be able to reach its last token, or it would evict
        # itself forever. (LLMEngine caps max_model_len to the pool, so this only trips direct use.)
        needed = self.kv.num_blocks_for(request.max_total_tokens)
        if needed > self.kv.pool.num_blocks:
            raise ValueError(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens needs {needed} KV blocks "
                f"but the pool holds only {self.kv.pool.num_blocks}; raise num_kv_blocks or lower max_tokens")
        if self.long_rope_length is not None and request.num_tokens > self.long_rope_length:
            request.rotate_long()
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.policy.fair:
            self.policy.join(request.params.tenant)
        if request.deadline is not None:
            self._num_with_deadline += 1
        if request.has_prompt_work:
            self._num_with_prompt_work += 1

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        self.finish(request, "abort")
        return request

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request now; its batch slot and KV blocks go back this same step."""
        if request.finish_reason is None:
            request.finish_reason = reason
        if reason in ("abort", "timeout"):
            self._ended_without_token.append(request)
        was_running = request.status is RequestStatus.RUNNING
        request.status = RequestStatus.FINISHED
        request.metrics.finished_time = self.clock()
        if request.deadline is not None:
            self._num_with_deadline -= 1
        if request.has_prompt_work:
            self._num_with_prompt_work -= 1
        if self.requests.pop(request.request_id, None) is not None and self.policy.fair:
            self.policy.leave(request.params.tenant)
        if request.params.adjusts_logits:
            self._ended_with_state.append(request.request_id)
        self.preemption.forget(request)
        if was_running:
            self._release_slot(request)
        else:
            self.waiting.remove(request)
            self.kv.free(request.request_id)

    def _release_slot(self, request: Request) -> None:
        """A running request ended: its slot and blocks go back."""
        self.running.remove(request)
        self._running_changed()
        self.kv.free(request.request_id)

    def _running_changed(self) -> None:
        self._running_changes += 1
        self.kept.batch = None

    def take_ended_with_state(self) -> list[str]:
        """Ids of the requests that ended since the last call and had state in the runner (penalty counts, a
        grammar matcher)."""
        ended, self._ended_with_state = self._ended_with_state, []
        return ended

    def drain_ended_without_token(self) -> list[Request]:
        ended, self._ended_without_token = self._ended_without_token, []
        return ended

    def scheduled_requests(self) -> list[Request]:
        """The requests of the latest ``schedule()``, in row order."""
        return self._in_flight[-1][0] if self._in_flight else []

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _expire_deadlines(self) -> None:
        if not self._num_with_deadline:
            return
        now = self.clock()
        for request in [r for r in (*self.waiting, *self.running) if r.deadline is not None and r.deadline <= now
                        and not r.is_finished]:
            self.finish(request, "timeout")

    def num_tokens_in_cache(self) -> int:
        return sum(r.num_computed_tokens for r in self.running)

    def rank(self, request: Request, now: float) -> Rank:
        return self.policy.rank(request, now)

    def kv_stats(self) -> KVCacheStats:
        return self.kv.stats(self.num_tokens_in_cache())
