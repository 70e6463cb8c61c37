"""Who runs this step. One rule: each scheduled request's computed tokens catch up with its tokens.

``ContinuousScheduler`` re-forms the batch every step (iteration-level scheduling);
``StaticScheduler`` keeps one batch until its longest member ends, for honest comparison.
Both share the queue, finishing and bookkeeping in ``Scheduler``.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

from inflight.engine.block_pool import BlockPool, KVCacheManager, KVCacheStats
from inflight.engine.config import EngineConfig
from inflight.engine.outputs import FinishReason
from inflight.engine.persistent_batch import PersistentBatch
from inflight.engine.request import Request, RequestStatus
from inflight.engine.scheduler_output import PLACEHOLDER_TOKEN_ID, PromptRow, SchedulerOutput


Rank = tuple[bool, float, int]  # Scheduler.rank's key: smaller is served first


def fresh_rank(priority: int, arrival_order: int, priority_policy: bool) -> Rank:
    """The rank of a request that has not aged (Scheduler.rank): by priority under the priority policy, then
    by arrival. Admission ranks newcomers with it too, away from the scheduler (ttft_predictor.QueueView)."""
    return (True, priority if priority_policy else 0, arrival_order)

class Scheduler:
    """Owns the waiting queue, the running set and the KV cache manager.

    Invariant: a request is in exactly one of ``waiting`` (FIFO, preempted requests at the front),
    ``running`` (holds a batch slot and KV blocks) or neither (finished, blocks already freed —
    except in static mode, where finished members keep their blocks until the batch ends).
    """

    prefix_caching = False  # subclasses that reuse cached prefixes turn it on
    keeps_decode_batch = False  # subclasses whose decode steps may run from a persistent batch turn it on

    def __init__(self, config: EngineConfig, num_kv_blocks: int) -> None:
        self.config = config
        self.kv = KVCacheManager(num_kv_blocks, config.block_size,
                                 enable_prefix_caching=self.prefix_caching and config.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Scheduled steps whose results have not been applied (update), oldest first: each step's rows as two
        # parallel lists (no tuple per row per step), the requests and the KV length each reaches. One step in
        # the synchronous loop; two while the engine schedules a step before the previous one's tokens are back
        # (async scheduling). Third: the step's proposed tokens by row (SchedulerOutput.spec_token_ids). Fourth: the
        # persistent batch that scheduled the step, if one did (its update then runs there too).
        self._in_flight: deque[tuple[list[Request], list[int], dict[int, list[int]], PersistentBatch | None]] = deque()
        # The persistent batch (persistent_batch.py): while the running set stays what it was when the general path
        # last scheduled a batch of decodes over all of it (``_decode_rows``), decode steps run from that batch.
        # ``_running_changes`` counts changes to the running set; the batch is dropped at each.
        self.use_persistent_batch = self.keeps_decode_batch and config.persistent_batch
        self._fcfs_admission = config.scheduling_policy == "fcfs" and config.max_queue_wait_s is None
        self._running_changes = 0
        self._decode_rows: list[Request] | None = None
        self._decode_rows_at = -1
        self._persistent: PersistentBatch | None = None
        self.num_persistent_steps = 0  # steps scheduled from the persistent batch
        self.last_update_kept = False  # the latest update ran in the persistent batch, and no row ended
        # Speculative decoding: a decode row also computes its request's ``spec_token_ids`` (set by the engine's
        # Speculator before each schedule) when blocks for them are free; they never cause a preemption.
        self.speculative = False
        self.num_appended: dict[str, int] = {}  # the latest update's requests that got several tokens: how many
        self._num_with_deadline = 0
        # Fair share (scheduling_policy "fair"): tokens of service each tenant has had (a virtual token counter),
        # and how many requests each has here (waiting or running).
        self._fair = config.scheduling_policy == "fair"
        self._service: dict[str | None, float] = {}
        self._tenant_requests: dict[str | None, int] = {}
        self._num_with_prompt_work = 0  # requests here with Request.has_prompt_work (prompt outputs, or no generation)
        # aborted, timed out, or prefill-only and done (they end without producing a token) since the last drain
        self._ended_without_token: list[Request] = []
        self._ended_with_state: list[str] = []  # ended, with state in the runner to drop (SchedulerOutput.ended_ids)
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.num_prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache at admission
        self.num_prefix_hit_tokens = 0  # of those, found there (not computed again)
        # Swapping: host blocks for preempted requests' KV, and the copies the next batch must make first.
        self.swap_pool: BlockPool | None = None
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        # Host blocks a pending swap-in still has to read: a swap-out in the same step must not get them,
        # since the runner makes the outs first.
        self._host_blocks_read: list[int] = []
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        # Seconds to recompute n tokens / to copy n blocks out and back; the engine sets measured ones.
        self.recompute_seconds: Callable[[int], float] = lambda tokens: tokens * 1e-4
        self.swap_seconds: Callable[[int], float] = lambda blocks: blocks * 1e-5

    def set_swap_space(self, num_blocks: int) -> None:
        self.swap_pool = BlockPool(num_blocks) if num_blocks > 0 else None

    # -- queue -----------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        # Even alone in the pool the request must be able to reach its last token, or it would evict
        # itself forever. (LLMEngine caps max_model_len to the pool, so this only trips direct use.)
        needed = self.kv.num_blocks_for(request.max_total_tokens)
        if needed > self.kv.pool.num_blocks:
            raise ValueError(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens needs {needed} KV blocks "
                f"but the pool holds only {self.kv.pool.num_blocks}; raise num_kv_blocks or lower max_tokens")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self._fair:
            self._join(request.params.tenant)
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
        request.metrics.finished_time = time.time()
        if request.deadline is not None:
            self._num_with_deadline -= 1
        if request.has_prompt_work:
            self._num_with_prompt_work -= 1
        if self.requests.pop(request.request_id, None) is not None and self._fair:
            self._tenant_requests[request.params.tenant] -= 1
        if request.params.adjusts_logits:
            self._ended_with_state.append(request.request_id)
        if request.swapped_blocks is not None:  # ended while swapped out: its host copy is no longer needed
            self.swap_pool.free(request.swapped_blocks)
            request.swapped_blocks = None
        if was_running:
            if self.config.batching == "static" and request.num_computed_tokens > 0:
                request.static_padding = True  # keeps slot and blocks until its batch ends
                return
            self.running.remove(request)
            self._running_changed()
        else:
            self.waiting.remove(request)
        self.kv.free(request.request_id)

    def _running_changed(self) -> None:
        self._running_changes += 1
        self._persistent = None

    def take_ended_with_state(self) -> list[str]:
        """Ids of the requests that ended since the last call and had state in the runner (penalty counts, a
        grammar matcher)."""
        ended, self._ended_with_state = self._ended_with_state, []
        return ended

    def _join(self, tenant: str | None) -> None:
        """A tenant's request arrives. A tenant with nothing here starts from the least-served active tenant's
        counter, not below it: idle time is not credit to spend on a burst later (VTC). When nobody has
        anything here, a new busy period starts and every counter starts again from zero."""
        if not self._tenant_requests.get(tenant):
            active = [self._service.get(t, 0.0) for t, n in self._tenant_requests.items() if n]
            if active:
                self._service[tenant] = max(self._service.get(tenant, 0.0), min(active))
            else:
                self._service.clear()
        self._tenant_requests[tenant] = self._tenant_requests.get(tenant, 0) + 1

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
        now = time.time()
        for request in [r for r in (*self.waiting, *self.running) if r.deadline is not None and r.deadline <= now
                        and not r.is_finished]:
            self.finish(request, "timeout")

    # -- one step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """This step's batch. The scheduled tokens count as computed from here on (their KV is written by the
        time anything reads it: steps run in order), and each row that samples owes its request a pending
        token until ``update`` brings it."""
        self._expire_deadlines()
        out = self._schedule_persistent()
        if out is not None:
            return out
        self._persistent = None  # the general path changes what its arrays mirror
        picked = self._pick()
        requests, counts = list(picked), list(picked.values())
        out = self._build_output(requests, counts)
        ends = []
        service = self._service if self._fair else None
        for request, num_new, sample in zip(requests, counts, out.sample):
            if not request.static_padding:
                request.num_computed_tokens += num_new
                request.num_pending_tokens += sample
                if service is not None:  # what the tenant is served: the tokens computed for it
                    tenant = request.params.tenant
                    service[tenant] = service.get(tenant, 0.0) + num_new
            ends.append(request.num_computed_tokens)
        if requests:
            self._in_flight.append((requests, ends, out.spec_token_ids, None))
        # A batch of single-token decodes that sample, over the whole running set: the next steps may keep it.
        decodes_all = (self.use_persistent_batch and requests and len(requests) == len(self.running)
                       and len(out.input_token_ids) == len(requests) and all(out.sample) and not out.spec_token_ids
                       and not out.prompt_rows)
        self._decode_rows, self._decode_rows_at = (requests if decodes_all else None), self._running_changes
        return out

    def _schedule_persistent(self) -> SchedulerOutput | None:
        """This step from the persistent batch, when it is the step the general path would schedule: the running
        set is unchanged since a batch of decodes over all of it, nothing else asks for a look (a queue that could
        be admitted, prompt work, proposals, fair-share counters, state or KV copies to hand over), and every row
        still decodes one token whose block is there or can be had without preempting. Else None."""
        rows = self._decode_rows
        if (rows is None or self._decode_rows_at != self._running_changes or self.speculative or self._fair
                or self._num_with_prompt_work or self._ended_with_state or self._swap_out or self._swap_in
                or len(rows) > self.config.max_num_batched_tokens):
            return None
        # A queue is looked at only if it could get in: a free slot, or a policy under which a newcomer preempts.
        if self.waiting and not (len(self.running) >= self.config.max_num_seqs and self._fcfs_admission):
            return None
        batch = self._persistent
        if batch is None:
            batch = self._persistent = PersistentBatch(rows, self.kv)
        scheduled = batch.schedule(self.kv)
        if scheduled is None:
            self._persistent = self._decode_rows = None
            return None
        out, ends = scheduled
        self._in_flight.append((batch.rows, ends, {}, batch))
        self.num_persistent_steps += 1
        return out

    def scheduled_by_persistent_batch(self) -> PersistentBatch | None:
        """The persistent batch, if the latest ``schedule()`` came from it."""
        return self._in_flight[-1][3] if self._in_flight else None

    def _pick(self) -> dict[Request, int]:
        """This step's rows, in order: each request and how many of its tokens to compute."""
        raise NotImplementedError

    def _build_output(self, requests: list[Request], counts: list[int]) -> SchedulerOutput:
        # Runs for every row of every step: bound appends and locals instead of attribute lookups.
        out = SchedulerOutput()
        add_id, add_input, extend_input = out.request_ids.append, out.input_token_ids.append, out.input_token_ids.extend
        add_query_len, add_start, add_sample = out.query_lens.append, out.start_positions.append, out.sample.append
        add_padding = out.padding.append
        now = None
        for request, num_new in zip(requests, counts):
            start = request.num_computed_tokens
            add_id(request.request_id)
            if request.static_padding:
                # Recompute the last position against the cached context; nothing is kept.
                add_input(request.all_token_ids[start - 1])
                add_query_len(1)
                add_start(start - 1)
                add_sample(False)
                add_padding(True)
            else:
                token_ids = request.all_token_ids
                if num_new == 1:
                    if start < len(token_ids):
                        add_input(token_ids[start])
                    else:  # the token an in-flight step samples: the runner puts it in
                        out.placeholder_rows.append(len(out.request_ids) - 1)
                        add_input(PLACEHOLDER_TOKEN_ID)
                elif start + num_new > len(token_ids):  # a decode row and its proposed tokens, to verify
                    proposed = list(request.spec_token_ids[:start + num_new - len(token_ids)])
                    extend_input(token_ids[start:])
                    extend_input(proposed)
                    out.spec_token_ids[len(out.request_ids) - 1] = proposed
                else:
                    extend_input(token_ids[start:start + num_new])
                add_query_len(num_new)
                add_start(start)
                add_sample(start + num_new >= len(token_ids) + request.num_pending_tokens)
                add_padding(False)
                metrics = request.metrics
                if metrics.first_scheduled_time is None:
                    now = now or time.time()
                    metrics.first_scheduled_time = now
        # copies (C loops, every row): the KV manager grows its lists for the next step while the runner reads these
        out.block_tables = list(map(list.copy, map(self.kv.block_tables.__getitem__, out.request_ids)))
        if self._num_with_prompt_work:
            self._add_prompt_rows(out, requests)
        if self._ended_with_state and requests:
            out.ended_ids = self.take_ended_with_state()
        if requests and (self._swap_out or self._swap_in):
            # Copies ride with a batch that has rows: only a forward could overwrite the blocks they read.
            out.swap_out, out.swap_in, self._swap_out, self._swap_in = self._swap_out, self._swap_in, [], []
            self.swap_pool.free(self._host_blocks_read)
            self._host_blocks_read = []
        return out

    @staticmethod
    def _add_prompt_rows(out: SchedulerOutput, requests: list[Request]) -> None:
        """Prefill-only rows sample nothing; rows that owe prompt logprobs or pooled states say so."""
        for row, request in enumerate(requests):
            if not request.has_prompt_work or request.static_padding:
                continue
            end = out.start_positions[row] + out.query_lens[row]
            if request.prefill_only:
                out.sample[row] = False
            if request.needs_prompt_outputs():
                prompt = request.prompt_token_ids
                num_top = request.params.prompt_logprobs if request.prompt_logprobs is not None else None
                out.prompt_rows[row] = PromptRow(num_top, request.pool, prompt[end] if end < len(prompt) else None)

    def update(self, sampled_token_ids: list[int | None],
               accepted_token_ids: dict[int, list[int]] | None = None) -> list[Request]:
        """Apply the results of the oldest scheduled step: append samples, end finished requests, cache the
        blocks its KV filled. A request that ended meanwhile (a stop in the previous step, an abort, a
        deadline) drops its token; one preempted meanwhile keeps it (the token is real).

        A row that verified proposed tokens (speculative decoding) emits its sampled token and then
        ``accepted_token_ids[row]``, the tokens sampled after it (as many as proposals were accepted); the KV
        written for the proposals after those is not valid, so its computed count rolls back over them and
        their slots are written again later. Only tokens whose KV is valid are ever hashed into the prefix cache.

        Returns the requests that produced a token this step (finished ones included).
        """
        requests, ends, proposed_by_row, kept = self._in_flight.popleft()
        # Scheduled from the persistent batch, and the running set unchanged since: apply it there. (The batch may
        # have been rebuilt meanwhile from the same rows, after a general step: it mirrors the requests either way.)
        batch = self._persistent
        if kept is not None and batch is not None and batch.rows is requests and None not in sampled_token_ids:
            return self._update_persistent(batch, ends, sampled_token_ids, kept is batch)
        self._persistent = None  # the general path below changes what its arrays mirror
        self.last_update_kept = False
        if proposed_by_row:
            self._roll_back_rejected(requests, ends, proposed_by_row, accepted_token_ids or {})
        if self.num_appended:
            self.num_appended = {}
        advanced: list[Request] = []
        finished: list[Request] = []
        add_advanced = advanced.append
        done = RequestStatus.FINISHED
        kv = self.kv
        caching, block_size, num_hashed_blocks = kv.enable_prefix_caching, kv.block_size, kv.num_hashed_blocks
        for row, (request, end, token_id) in enumerate(zip(requests, ends, sampled_token_ids)):
            if request.static_padding or request.status is done:
                continue
            if token_id is not None:
                request.num_pending_tokens -= 1
                add_advanced(request)
                if request.append_token(token_id) or (proposed_by_row and row in proposed_by_row
                                                      and self._append_accepted(request, accepted_token_ids[row])):
                    finished.append(request)
            elif end == request.max_total_tokens:  # a prefill-only request's last chunk: it is done
                request.finish_reason = "length"
                finished.append(request)
                self._ended_without_token.append(request)
            # after the tokens are appended: a speculative row's valid KV reaches into them
            # (_cache_filled's first test, inline: this runs for every row, and a block fills for ~1 in block_size)
            if caching and end >= (num_hashed_blocks(request.request_id) + 1) * block_size:
                self._cache_filled(request, end)
        for request in finished:
            self.finish(request, request.finish_reason)
        self._on_step_end()
        return advanced

    def _update_persistent(self, batch: PersistentBatch, ends: list[int], token_ids: list[int],
                           scheduled_here: bool) -> list[Request]:
        """``update`` for a step of the persistent batch (``batch``, or an earlier one of the same rows): every row
        got one token."""
        if self.num_appended:
            self.num_appended = {}
        rows = batch.rows
        finished = [rows[row] for row in batch.apply(token_ids)]
        filling = batch.rows_filling_a_block(ends, scheduled_here)  # (taken either way: the batch counts steps)
        if self.kv.enable_prefix_caching:  # one token a step: a block fills exactly when the KV reaches its end
            for row in filling:
                self._cache_filled(rows[row], ends[row])
        for request in finished:
            self.finish(request, request.finish_reason)
        self._on_step_end()
        self.last_update_kept = not finished
        return list(rows)

    def _cache_filled(self, request: Request, end: int) -> None:
        """Hash the request's blocks that KV up to ``end`` filled into the prefix cache, if that KV is valid."""
        kv = self.kv
        if (request.status is RequestStatus.RUNNING and end <= request.num_computed_tokens
                and end >= (kv.num_hashed_blocks(request.request_id) + 1) * kv.block_size
                and end <= len(request.all_token_ids)):
            kv.cache_computed_blocks(request.request_id, request.all_token_ids, end, request.cache_root)

    def _append_accepted(self, request: Request, token_ids: list[int]) -> bool:
        """A speculative row's tokens after its first, in order (how many tokens the row got goes into
        ``num_appended``); True if one ended the request (the rest are dropped: they would not have been
        generated)."""
        appended, ended = 1, False
        for token_id in token_ids:
            appended += 1
            if request.append_token(token_id):
                ended = True
                break
        if appended > 1:
            self.num_appended[request.request_id] = appended
        return ended

    @staticmethod
    def _roll_back_rejected(requests: list[Request], ends: list[int], proposed_by_row: dict[int, list[int]],
                            accepted_token_ids: dict[int, list[int]]) -> None:
        for row, proposed in proposed_by_row.items():
            request = requests[row]
            rejected = len(proposed) - len(accepted_token_ids.get(row, ()))
            ends[row] -= rejected
            if request.status is RequestStatus.RUNNING:
                request.num_computed_tokens -= rejected

    def _on_step_end(self) -> None:
        pass

    # -- introspection -------------------------------------------------------------------------
    def num_tokens_in_cache(self) -> int:
        return sum(r.num_computed_tokens for r in self.running)

    def rank(self, request: Request, now: float) -> Rank:
        """Who is served first (smallest) and preempted first (largest).

        First, aged requests, oldest first whatever their priority: a request is aged once it has waited
        ``max_queue_wait_s`` since arrival without ever being scheduled, and it stays aged until it ends
        (so, once in, it is not preempted by the urgent work it jumped). Requests preempted after their
        first admission do not age again: their age would let them preempt in turn, a cascade that costs
        recomputation and makes everyone wait. Then (policy ``priority``) the lower priority value, or (policy
        ``fair``) the tenant that has had the fewest tokens of service; then the earlier arrival."""
        if not request.aged:
            max_wait = self.config.max_queue_wait_s
            if (max_wait is None or request.metrics.first_scheduled_time is not None
                    or now - request.metrics.arrival_time < max_wait):
                if self._fair:  # the least-served tenant first, then arrival
                    return (True, self._service.get(request.params.tenant, 0.0), request.arrival_order)
                return fresh_rank(request.priority, request.arrival_order,
                                  self.config.scheduling_policy == "priority")
            request.aged = True
        return (False, 0, request.arrival_order)

    def kv_stats(self) -> KVCacheStats:
        return self.kv.stats(self.num_tokens_in_cache())


class ContinuousScheduler(Scheduler):
    """Iteration-level scheduling over a paged KV cache.

    Each step, in this order:
      1. every running request advances: decodes take one token each, then unfinished prefills
         take chunks from what is left of the token budget;
      2. waiting requests are admitted in ``rank`` order while a batch slot, budget and blocks remain:
         blocks for the request's whole prompt and ``kv_headroom_tokens`` of output, beside the same for every
         running request (``_headroom_blocks``), so that admitting does not make decode growth preempt
         someone a few steps later. A request's cached prefix (``enable_prefix_caching``) is taken over,
         not computed. With
         ``admission_mode="guaranteed_no_evict"`` a request is admitted only if blocks for its whole
         prompt + max_tokens can be reserved now, so nothing is ever preempted;
      3. if blocks run out, the running request ranked last (aged requests last of all, then the
         worst priority, then the newest) is preempted: its blocks are freed (full ones stay cached)
         and it goes back to the queue, to be recomputed. A waiting request that outranks the last
         running one by age or by priority also preempts it to get in: that is what bounds a
         request's wait to ``max_queue_wait_s`` under a flood of higher-priority work.
    Finished requests already left in ``update`` of the step they finished in.
    """

    prefix_caching = True
    keeps_decode_batch = True

    def _pick(self) -> dict[Request, int]:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[Request, int] = {}
        preemptions_before = self.num_preemptions
        tables, block_size = self.kv.block_tables, self.kv.block_size
        running_status = RequestStatus.RUNNING
        speculative = self.speculative
        decoding, prefilling = [], []
        for request in self.running:
            known = len(request.all_token_ids) + request.num_pending_tokens  # pending: sampled by an in-flight step
            if request.num_pending_tokens and known >= request.max_total_tokens:
                continue  # its last token is in flight: it ends when that lands
            left = known - request.num_computed_tokens
            if left == 1:
                decoding.append(request)
            elif left > 1:
                prefilling.append(request)
        now = time.time()
        for request in decoding:
            if request.status is not running_status or budget == 0:
                continue  # preempted earlier in this loop
            if not speculative:  # _take's first case, inline: most decode rows hold a slot for their token already
                table = tables.get(request.request_id)
                if table is not None and request.num_computed_tokens < len(table) * block_size:
                    scheduled[request] = 1
                    budget -= 1
                    continue
            budget = self._take(request, scheduled, budget, now)
        for request in prefilling:
            if request.status is running_status and budget:  # (not preempted earlier in this loop)
                budget = self._take(request, scheduled, budget, now)

        # Admitting new work right after a shortage preemption would only evict it again next step.
        if self.num_preemptions == preemptions_before:
            self._admit(scheduled, budget, now)
        return scheduled

    def _take(self, request: Request, scheduled: dict[Request, int], budget: int, now: float) -> int:
        """Schedule the running ``request``'s next tokens, as many as ``budget`` allows (a decode row's proposed
        tokens too, if their blocks are free), allocating blocks for them and preempting the lowest-ranked
        running requests while none are free. Returns the budget left."""
        tables, block_size = self.kv.block_tables, self.kv.block_size
        computed = request.num_computed_tokens
        num_new = len(request.all_token_ids) + request.num_pending_tokens - computed
        if self.speculative and num_new == 1 and request.spec_token_ids:
            if self.kv.can_fit(request.request_id, computed + 1 + len(request.spec_token_ids)):
                num_new += len(request.spec_token_ids)  # the budget may cut them short, below
            else:
                request.spec_token_ids = ()  # no free blocks for them: decode plainly
        if num_new > budget:
            num_new = budget
        table = tables.get(request.request_id)
        if table is not None and computed + num_new <= len(table) * block_size:
            scheduled[request] = num_new  # its blocks hold these tokens already: no allocate
            return budget - num_new
        while not self.kv.allocate(request.request_id, computed + num_new):
            victim = max(self.running, key=lambda r: self.rank(r, now))
            budget += scheduled.pop(victim, 0)
            self._preempt(victim)
            if victim is request:
                return budget
        scheduled[request] = num_new
        return budget - num_new

    def _admit(self, scheduled: dict[Request, int], budget: int, now: float) -> None:
        config, kv = self.config, self.kv
        guaranteed = config.admission_mode == "guaranteed_no_evict"
        # Without priorities or aging the queue's own (arrival) order is the rank order: no need to search it.
        by_rank = config.scheduling_policy != "fcfs" or config.max_queue_wait_s is not None
        preempted_now: set[Request] = set()
        # (None: no headroom asked for, or every request reserves its whole max_tokens anyway)
        running_headroom = None if guaranteed or not config.kv_headroom_tokens else self._headroom_blocks(self.running)
        while self.waiting and budget > 0:
            request = min(self.waiting, key=lambda r: self.rank(r, now)) if by_rank else self.waiting[0]
            if request in preempted_now:
                break  # it just made room for a better request that still does not fit: let blocks free up first
            hit = 0
            if request.num_computed_tokens == 0 and not (request.has_prompt_work and request.needs_prompt_outputs()):
                hit = kv.match_prefix(request.request_id, request.all_token_ids, request.cache_root)
                request.num_computed_tokens = hit
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            wanted = request.max_total_tokens if guaranteed else request.num_computed_tokens + num_new
            fits = len(self.running) < config.max_num_seqs and (
                running_headroom is None or not self.running
                or self._headroom_blocks([request]) + running_headroom <= kv.pool.num_free)
            if fits and kv.allocate(request.request_id, wanted):
                self.waiting.remove(request)
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                self._running_changed()
                if request.swapped_blocks is not None:  # its KV comes back into the first blocks of its new table
                    host = request.swapped_blocks
                    self._swap_in.extend(zip(host, kv.block_tables[request.request_id]))
                    self._host_blocks_read.extend(host)  # freed once the copy is handed out, not before
                    self.num_swapped_in_blocks += len(host)
                    request.swapped_blocks = None
                scheduled[request] = num_new
                budget -= num_new
                if running_headroom is not None:
                    running_headroom += self._headroom_blocks([request])
                self.num_prefix_query_tokens += request.num_tokens
                self.num_prefix_hit_tokens += hit
                continue
            if hit:  # not admitted: give the cached blocks back
                kv.free(request.request_id)
                request.num_computed_tokens = 0
            victim = None if guaranteed else self._make_room_for(request, scheduled, now)
            if victim is None:
                break
            preempted_now.add(victim)
            budget = config.max_num_batched_tokens - sum(scheduled.values())
            if running_headroom is not None:
                running_headroom = self._headroom_blocks(self.running)

    def _headroom_blocks(self, requests: list[Request]) -> int:
        """Blocks the requests still need for their whole prompts and ``kv_headroom_tokens`` more tokens each
        (up to their max_tokens), beyond the blocks they hold."""
        headroom, kv = self.config.kv_headroom_tokens, self.kv
        need = 0
        for request in requests:
            held = len(kv.block_tables.get(request.request_id, ()))
            target = min(len(request.all_token_ids) + headroom, request.max_total_tokens)
            need += max(0, kv.num_blocks_for(target) - held)
        return need

    def _make_room_for(self, request: Request, scheduled: dict[Request, int], now: float) -> Request | None:
        """Preempt the last-ranked running request if ``request`` outranks it by age or priority (not by
        arrival alone: fcfs never preempts for newcomers). Returns the victim, if any.
        Age preempts only requests that arrived after it (that jumped the queue by priority or tenant): an earlier
        arrival frees its blocks by finishing, and preempting it to recompute later only wastes work (under fcfs
        in an overload, every waiting request aged into preempting an older running one)."""
        mine = self.rank(request, now)  # (ages the request if it is due)
        candidates = self.running
        if request.aged:
            candidates = [r for r in self.running if r.arrival_order > request.arrival_order]
        if not candidates:
            return None
        victim = max(candidates, key=lambda r: self.rank(r, now))
        theirs = self.rank(victim, now)
        # Age, or priority, preempts. Under fair share a tenant with nothing running preempts the most-served
        # tenant's newest request (the cheapest to recompute) to get its first slot; once it runs, its share
        # is honoured at admission only (counters move every step: preempting by them would ping-pong).
        if self._fair:
            tenant = request.params.tenant
            starved = mine[1] < theirs[1] and not any(r.params.tenant == tenant for r in self.running)
            if mine[:1] >= theirs[:1] and not starved:
                return None
        elif mine[:2] >= theirs[:2]:
            return None
        scheduled.pop(victim, None)
        self._preempt(victim)
        return victim

    def _preempt(self, request: Request) -> None:
        """Take the request's slot and blocks. Its KV is swapped to host blocks if that is allowed, fits,
        and (``preemption_mode="auto"``) costs less time than recomputing it; else it is recomputed."""
        self.running.remove(request)
        self._running_changed()
        self.num_preemptions += 1
        request.metrics.num_preemptions += 1
        # only the blocks holding computed KV are worth copying
        table = self.kv.block_tables.get(request.request_id, [])[:self.kv.num_blocks_for(request.num_computed_tokens)]
        if self._should_swap(request, len(table)):
            host = self.swap_pool.allocate(len(table))
            self._swap_out.extend(zip(table, host))
            self.num_swapped_out_blocks += len(table)
            request.swapped_blocks = host
        else:
            self.num_recomputed_tokens += request.num_computed_tokens
            request.num_computed_tokens = 0
            if request.has_prompt_work:
                request.restart_prompt_outputs()
        self.kv.free(request.request_id)
        request.status = RequestStatus.WAITING
        self._requeue(request)

    def _should_swap(self, request: Request, num_blocks: int) -> bool:
        mode = self.config.preemption_mode
        if mode == "recompute" or self.swap_pool is None or not num_blocks or num_blocks > self.swap_pool.num_free:
            return False
        return mode == "swap" or self.swap_seconds(num_blocks) < self.recompute_seconds(request.num_computed_tokens)

    def _requeue(self, request: Request) -> None:
        """Back into the queue at its arrival position, so the fcfs queue stays in arrival order."""
        order = request.arrival_order
        index = next((i for i, r in enumerate(self.waiting) if r.arrival_order > order), len(self.waiting))
        self.waiting.insert(index, request)


class StaticScheduler(Scheduler):
    """Request-level batching, as systems before paging did it.

    A batch forms in arrival order (up to ``max_num_seqs``) only once KV for prompt + max_tokens of
    every member is reserved. All members prefill, then decode in lockstep until the longest one
    ends; members that end early keep their slot and are computed as padding. Nobody joins a
    running batch. Blocks are returned when the whole batch ends.
    """

    def _pick(self) -> dict[Request, int]:
        if not self.running:
            self._form_batch()
        if not self.running:
            return {}
        prefilling = [r for r in self.running if not r.static_padding
                      and r.num_tokens - r.num_computed_tokens > 1]
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
        return dict.fromkeys(self.running, 1)

    def _form_batch(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not self.kv.allocate(request.request_id, request.max_total_tokens):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._running_changed()

    def _on_step_end(self) -> None:
        if self.running and all(r.static_padding for r in self.running):
            for request in self.running:
                self.kv.free(request.request_id)
            self.running = []
            self._running_changed()


def make_scheduler(config: EngineConfig, num_kv_blocks: int) -> Scheduler:
    cls = StaticScheduler if config.batching == "static" else ContinuousScheduler
    return cls(config, num_kv_blocks)
