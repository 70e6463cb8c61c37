"""Who runs this step. One rule: each scheduled request's computed tokens catch up with its tokens.

``Scheduler`` re-forms the batch every step (iteration-level scheduling). Around it: who goes first and who may
be preempted for whom (``scheduling_policy.py``), what happens to a preempted request's KV (``preemption.py``),
the batch as the runner's arrays (``batch_builder.py``), the decode batch kept across steps
(``persistent_batch.py``), and request-level batching for comparison (``static_scheduler.StaticScheduler``).
"""

from __future__ import annotations

from inflight.engine.batch_builder import build_batch
from inflight.engine.config import EngineConfig
from inflight.engine.persistent_batch import PersistentBatch
from inflight.engine.request import Request, RequestStatus
from inflight.engine.scheduler_output import SchedulerOutput
from inflight.engine.scheduler_state import SchedulerState


class Scheduler(SchedulerState):
    """Iteration-level scheduling over a paged KV cache: the batch is re-formed every step.

    Who is here (waiting, running, ended) is ``SchedulerState``'s; who runs is decided here. Each step, in order:
      1. every running request advances: decodes take one token each (and their proposed tokens, when
         speculating and their blocks are free), then unfinished prefills take chunks of what is left of the
         token budget (``max_num_batched_tokens``);
      2. waiting requests are admitted in ``rank`` order while a batch slot, budget and blocks remain: blocks for
         the request's whole prompt and ``kv_headroom_tokens`` of output, beside the same for every running
         request, so that admitting does not make decode growth preempt someone a few steps later. A cached
         prefix (``enable_prefix_caching``) is taken over, not computed. With
         ``admission_mode="guaranteed_no_evict"`` a request is admitted only if blocks for its whole prompt +
         max_tokens can be reserved now, so nothing is ever preempted;
      3. if blocks run out, the running request ranked last is preempted (``Preemption``: its KV swapped out or
         dropped, its slot and blocks freed) and goes back to the queue. A waiting request that outranks the last
         running one by age or priority also preempts it to get in (``SchedulingPolicy.victim_for``): that is
         what bounds a request's wait to ``max_queue_wait_s`` under a flood of higher-priority work.
    Scheduled tokens count as computed from ``schedule`` on; ``update`` applies the sampled tokens, and finished
    requests leave in the step they finished in.
    """

    def __init__(self, config: EngineConfig, num_kv_blocks: int, window: tuple[int, int] | None = None) -> None:
        super().__init__(config, num_kv_blocks, window)
        # Speculative decoding: a decode row also computes its request's ``spec_token_ids`` (set by the engine's
        # Speculator before each schedule) when blocks for them are free; they never cause a preemption.
        self.speculative = False
        self.num_appended: dict[str, int] = {}  # the latest update's requests that got several tokens: how many
        self.num_prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache at admission
        self.num_prefix_hit_tokens = 0  # of those, found there (not computed again)

    # -- one step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """This step's batch. The scheduled tokens count as computed from here on (their KV is written by the
        time anything reads it: steps run in order), and each row that samples owes its request a pending
        token until ``update`` brings it."""
        self._expire_deadlines()
        out = self._schedule_kept()
        if out is not None:
            return out
        self.kept.batch = None  # the general path changes what its arrays mirror
        picked = self._pick()
        requests, counts = list(picked), list(picked.values())
        out = self._build_batch(requests, counts)
        ends = []
        service = self.policy.service if self.policy.fair else None
        for request, num_new, sample in zip(requests, counts, out.sample):
            request.num_computed_tokens += num_new
            request.num_pending_tokens += sample
            if service is not None:  # what the tenant is served: the tokens computed for it
                tenant = request.params.tenant
                service[tenant] = service.get(tenant, 0.0) + num_new
            ends.append(request.num_computed_tokens)
        if requests:
            self._in_flight.append((requests, ends, out.spec_token_ids, None))
        self.kept.note_general_step(requests, out, len(self.running), self._running_changes)
        return out

    def _build_batch(self, requests: list[Request], counts: list[int]) -> SchedulerOutput:
        out = build_batch(requests, counts, self.kv, bool(self._num_with_prompt_work), self.long_rope_length is not None,
                          self.clock)
        if self._ended_with_state and requests:
            out.ended_ids = self.take_ended_with_state()
        if requests and self.preemption.has_copies:
            # Copies ride with a batch that has rows: only a forward could overwrite the blocks they read.
            out.swap_out, out.swap_in = self.preemption.take_copies()
        return out

    def _schedule_kept(self) -> SchedulerOutput | None:
        """This step from the persistent batch, when it is the step the general path would schedule: the running
        set is unchanged since a batch of decodes over all of it, nothing else asks for a look (a queue that could
        be admitted, prompt work, proposals, fair-share counters, state or KV copies to hand over), and every row
        still decodes one token whose block is there or can be had without preempting. Else None."""
        rows = self.kept.rows_if_unchanged(self._running_changes)
        if rows is not None and self.long_rope_length is not None and any(
                not r.long_rope and len(r.all_token_ids) + r.num_pending_tokens > self.long_rope_length for r in rows):
            return None  # a row grows past LongRoPE's original length: the general path recomputes it long
        if (rows is None or self.speculative or self.policy.fair or self._num_with_prompt_work
                or self._ended_with_state or self.preemption.has_copies or len(rows) > self.config.max_num_batched_tokens):
            return None
        # A queue is looked at only if it could get in: a free slot, or a policy under which a newcomer preempts.
        if self.waiting and not (len(self.running) >= self.config.max_num_seqs and self.policy.in_arrival_order):
            return None
        scheduled = self.kept.schedule(self.kv)
        if scheduled is None:
            return None
        out, ends, batch = scheduled
        self._in_flight.append((batch.rows, ends, {}, batch))
        return out

    def scheduled_by_persistent_batch(self) -> PersistentBatch | None:
        """The persistent batch, if the latest ``schedule()`` came from it."""
        return self._in_flight[-1][3] if self._in_flight else None

    def _pick(self) -> dict[Request, int]:
        """This step's rows, in order: each request and how many of its tokens to compute (rule 1, then 2)."""
        budget = self.config.max_num_batched_tokens
        scheduled: dict[Request, int] = {}
        preemptions_before = self.preemption.num_preemptions
        tables, block_size = self.kv.block_tables, self.kv.block_size
        running_status = RequestStatus.RUNNING
        speculative = self.speculative
        decoding, prefilling, crossing = [], [], []
        long_length = self.long_rope_length
        for request in self.running:
            known = len(request.all_token_ids) + request.num_pending_tokens  # pending: sampled by an in-flight step
            if request.num_pending_tokens and known >= request.max_total_tokens:
                continue  # its last token is in flight: it ends when that lands
            if long_length is not None and known > long_length and not request.long_rope:
                crossing.append(request)  # LongRoPE: past the original length every position is rotated long
                continue
            left = known - request.num_computed_tokens
            if left == 1:
                decoding.append(request)
            elif left > 1:
                prefilling.append(request)
        for request in crossing:  # its KV, rotated short, is dropped and computed again long, as transformers does
            request.rotate_long()
            self._preempt(request, recompute=True)
        now = self.clock()
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
        if self.preemption.num_preemptions == preemptions_before:
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
        while not self.kv.allocate(request.request_id, computed + num_new, start=computed):
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
        by_rank = not self.policy.in_arrival_order
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
                    self.preemption.swap_in(request, kv.block_tables[request.request_id])
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
            victim = None if guaranteed else self.policy.victim_for(request, self.running, now)
            if victim is None:
                break
            scheduled.pop(victim, None)
            self._preempt(victim)
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

    def _preempt(self, request: Request, recompute: bool = False) -> None:
        """Take the request's slot and blocks (its KV swapped out or dropped: ``Preemption``; ``recompute``: dropped),
        back to the queue at its arrival position, so the fcfs queue stays in arrival order."""
        self.running.remove(request)
        self._running_changed()
        self.preemption.release(request, self.kv, recompute)
        request.status = RequestStatus.WAITING
        order = request.arrival_order
        index = next((i for i, r in enumerate(self.waiting) if r.arrival_order > order), len(self.waiting))
        self.waiting.insert(index, request)

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
        requests, ends, proposed_by_row, scheduled_by = self._in_flight.popleft()
        if self.kept.applies_to(scheduled_by, requests, sampled_token_ids):
            return self._update_kept(ends, sampled_token_ids, scheduled_by is self.kept.batch)
        self.kept.batch = None  # the general path below changes what its arrays mirror
        self.kept.last_update_kept = False
        if proposed_by_row:
            roll_back_rejected(requests, ends, proposed_by_row, accepted_token_ids or {})
        if self.num_appended:
            self.num_appended = {}
        advanced: list[Request] = []
        finished: list[Request] = []
        add_advanced = advanced.append
        done = RequestStatus.FINISHED
        kv = self.kv
        caching, block_size, num_hashed_blocks = kv.enable_prefix_caching, kv.block_size, kv.num_hashed_blocks
        for row, (request, end, token_id) in enumerate(zip(requests, ends, sampled_token_ids)):
            if request.status is done:
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

    def _update_kept(self, ends: list[int], token_ids: list[int], scheduled_here: bool) -> list[Request]:
        """``update`` for a step of the persistent batch: every row got one token."""
        if self.num_appended:
            self.num_appended = {}
        rows = self.kept.batch.rows
        finished, filling = self.kept.apply(ends, token_ids, scheduled_here)
        if self.kv.enable_prefix_caching:  # one token a step: a block fills exactly when the KV reaches its end
            for row in filling:
                self._cache_filled(rows[row], ends[row])
        for request in finished:
            self.finish(request, request.finish_reason)
        self._on_step_end()
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

    def _on_step_end(self) -> None:
        pass


def roll_back_rejected(requests: list[Request], ends: list[int], proposed_by_row: dict[int, list[int]],
                       accepted_token_ids: dict[int, list[int]]) -> None:
    """The KV written for a speculative row's rejected proposals is not valid: its KV length (and its request's
    computed count, if it still runs) rolls back over them."""
    for row, proposed in proposed_by_row.items():
        request = requests[row]
        rejected = len(proposed) - len(accepted_token_ids.get(row, ()))
        ends[row] -= rejected
        if request.status is RequestStatus.RUNNING:
            request.num_computed_tokens -= rejected


def make_scheduler(config: EngineConfig, num_kv_blocks: int, window: tuple[int, int] | None = None) -> Scheduler:
    if config.batching == "static":
        from inflight.engine.static_scheduler import StaticScheduler

        return StaticScheduler(config, num_kv_blocks, window)
    return Scheduler(config, num_kv_blocks, window)
