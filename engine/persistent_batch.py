"""The decode batch kept from step to step, so a step of pure decodes costs no Python work per row.

Most steps of a busy engine are the same running requests decoding one token each. The general scheduler walks
every request three or four times a step in Python (choose the rows, build the batch, apply the tokens, report
them): ~400 bytecodes per request, most of the host's time at 256 requests. While the running set does not change,
the scheduler keeps that batch instead (vLLM's persistent input batch is the same idea): its rows' counters live
in arrays next to the requests, each step applies only the difference (one position further, a block for the
rows that filled theirs, the sampled tokens), and the per-row work left runs in C (numpy, and ``map`` over bound
methods and ``setattr``), not in bytecode.

The arrays mirror the requests' own fields, which stay the truth: every step through here writes both, and the
batch is dropped (to be rebuilt from the requests) whenever anything else touches its rows: a request added to
or removed from the running set (admitted, finished, preempted) or a step applied by the general path.
"""

from __future__ import annotations

from collections import deque
from itertools import compress, repeat
from operator import attrgetter, itemgetter, mod, not_
from typing import TYPE_CHECKING

import numpy as np

from inflight.engine.scheduler_output import PLACEHOLDER_TOKEN_ID, SchedulerOutput

if TYPE_CHECKING:
    from inflight.engine.block_pool import KVCacheManager
    from inflight.engine.request import Request

_ID, _COMPUTED, _PENDING = attrgetter("request_id"), attrgetter("num_computed_tokens"), attrgetter("num_pending_tokens")
_ALL, _OUTPUT, _STOP_IDS = attrgetter("all_token_ids"), attrgetter("output_token_ids"), attrgetter("stop_ids")
_MAX_TOTAL, _PARAMS, _LAST = attrgetter("max_total_tokens"), attrgetter("params"), itemgetter(-1)


def consume(iterator) -> None:
    """Run a ``map`` of side effects (``setattr``, ``list.append``) to its end: a loop in C, not in bytecode."""
    deque(iterator, maxlen=0)


def _array(values, count: int) -> np.ndarray:
    return np.fromiter(values, dtype=np.int64, count=count)


class PersistentBatch:
    """The running requests, all decoding one token a step, in row order.

    ``rows`` must be the whole running set, each row's request with no prompt work, nothing speculative and not
    static padding, and each having sampled in the latest step: ``Scheduler._schedule_persistent`` keeps one only
    then. Per step it runs a handful of numpy calls and C loops, whatever the number of rows: on the benchmark VM,
    after the 8 ms stand-in device step of ``benchmarks.scheduler``, little of the host's data is still in the
    caches, and each numpy call or pass over the rows pays for that again (docs/benchmarks-history.md).
    """

    def __init__(self, rows: list[Request], kv: KVCacheManager) -> None:
        count = len(rows)
        self.rows = rows
        self.num_rows = count
        self.request_ids: list[str] = list(map(_ID, rows))
        # the requests' live tables: allocating grows them in place, so the batch sees new blocks without a copy
        self.tables: list[list[int]] = list(map(kv.block_tables.__getitem__, self.request_ids))
        self.window_tables: list[list[int]] | None = (list(map(kv.window_tables.__getitem__, self.request_ids))
                                                      if kv.window is not None else None)
        # rows whose prompts rotate long (a LongRoPE model's: SchedulerOutput.long_rope), None where none does
        self.long_rope: list[bool] | None = [r.long_rope for r in rows] if any(r.long_rope for r in rows) else None
        self.all_lists: list[list[int]] = list(map(_ALL, rows))
        self.output_lists: list[list[int]] = list(map(_OUTPUT, rows))
        self.params = list(map(_PARAMS, rows))  # what the sampler needs of each row: fixed for a request's life
        self.computed = _array(map(_COMPUTED, rows), count)
        num_tokens = _array(map(len, self.all_lists), count)
        self.max_total = _array(map(_MAX_TOTAL, rows), count)
        # Tokens and outputs grow by one per row per step: counted once for all rows since the batch was built.
        self.base_tokens, self.base_outputs = num_tokens, _array(map(len, self.output_lists), count)
        self.num_appended = 0
        # Every row owes the same number of in-flight tokens (0 in the synchronous loop, 1 with async scheduling)
        # and has exactly one token to compute: else the batch never schedules (the general path decides).
        pending = set(map(_PENDING, rows))
        uniform = len(pending) == 1
        self.num_pending = pending.pop() if uniform else 0
        self.usable = uniform and bool((num_tokens + self.num_pending - self.computed == 1).all())
        # Rows whose last block is full at step k (their KV reaches the block's end) fill one block every
        # block_size steps: bucketed by k % block_size, each step looks up its rows instead of comparing arrays.
        self.block_size = block_size = kv.block_size
        self.step = 0
        room = _array(map(len, self.tables), count) * block_size - self.computed
        self.due: list[list[int]] = [[] for _ in range(block_size)]
        for row, phase in enumerate((room % block_size).tolist()):
            self.due[phase].append(row)
        # Of each step this batch scheduled and that is not applied yet, oldest first: the rows whose KV fills a
        # block in it (reaching the block's end: the rows that need a new block in the step after).
        self._filling: deque[list[int]] = deque()
        self.stop_ids: list[frozenset[int]] = list(map(_STOP_IDS, rows))
        # When every row stops on the same tokens (the usual: the model's eos, or nothing), one set to test.
        shared = self.stop_ids[0] if count and self.stop_ids.count(self.stop_ids[0]) == count else None
        self.shared_stop_ids: frozenset[int] | None = shared
        # Each row's latest token, when the batch appended it: the next step's inputs (else read from the rows).
        self.last_token_ids: list[int] | None = None
        # Steps until the first row reaches its length limit: counted down, so most steps compare no arrays.
        self.steps_to_a_length_limit = int((self.max_total - num_tokens).min()) if count else 0

    def schedule(self, kv: KVCacheManager) -> tuple[SchedulerOutput, list[int]] | None:
        """The next step: every row decodes its next token. None if that is not this step's batch (a row waits for
        its last token, which is in flight) or a row's next block cannot be had: the general path then decides,
        with preemption. Else the batch and the KV length each row reaches."""
        if not self.usable:
            return None
        count, num_pending = self.num_rows, self.num_pending
        if num_pending:
            if self.steps_to_a_length_limit <= num_pending:
                return None  # a row's last token is in flight: it ends when that lands
            inputs = [PLACEHOLDER_TOKEN_ID] * count  # the in-flight step's samples: the runner puts them in
            placeholder_rows = list(range(count))
        else:  # the token at position ``computed`` is each row's last
            last = self.last_token_ids
            inputs = list(last) if last is not None else list(map(_LAST, self.all_lists))
            placeholder_rows = []
        computed, request_ids = self.computed, self.request_ids
        for row in self.due[self.step % self.block_size]:  # rows whose last block is full: ~1 in block_size
            if not kv.allocate(request_ids[row], int(computed[row]) + 1, start=int(computed[row])):
                return None
        self._filling.append(self.due[(self.step + 1) % self.block_size])
        self.step += 1
        starts = computed.tolist()
        computed += 1
        ends = computed.tolist()
        out = SchedulerOutput(
            request_ids=list(request_ids), input_token_ids=inputs, query_lens=[1] * count,
            start_positions=starts, block_tables=list(map(list.copy, self.tables)), sample=[True] * count,
            padding=[False] * count, placeholder_rows=placeholder_rows,
            window_tables=list(map(list.copy, self.window_tables)) if self.window_tables is not None else None,
            long_rope=self.long_rope)
        self.num_pending = num_pending = num_pending + 1
        consume(map(setattr, self.rows, repeat("num_computed_tokens"), ends))
        consume(map(setattr, self.rows, repeat("num_pending_tokens"), repeat(num_pending, count)))
        return out, ends

    def sampled_output_counts(self) -> list[int]:
        """Per row, the output tokens before the one this step samples (in-flight ones included)."""
        return (self.base_outputs + (self.num_appended + self.num_pending - 1)).tolist()

    def apply(self, token_ids: list[int]) -> list[int]:
        """Append each row's sampled token; returns the rows whose token ended their request (by the same rules
        and with the same reasons as ``Request.append_token``, which each such row runs again to decide)."""
        count = self.num_rows
        self.num_pending -= 1
        self.num_appended += 1
        consume(map(list.append, self.output_lists, token_ids))
        consume(map(list.append, self.all_lists, token_ids))
        self.last_token_ids = token_ids
        consume(map(setattr, self.rows, repeat("num_pending_tokens"), repeat(self.num_pending, count)))
        # Which rows to look at: a token in the row's stop set (C loops over set lookups; numpy's isin costs more
        # at these sizes), or a row at its length limit (only once the countdown says one may be).
        shared = self.shared_stop_ids
        if shared is not None:
            hit = list(map(shared.__contains__, token_ids)) if shared else None
        else:
            hit = list(map(frozenset.__contains__, self.stop_ids, token_ids))
        candidates = set(compress(range(count), hit)) if hit is not None and True in hit else set()
        self.steps_to_a_length_limit -= 1
        if self.steps_to_a_length_limit <= 0:
            num_tokens = self.base_tokens + self.num_appended
            candidates.update(np.flatnonzero(num_tokens >= self.max_total).tolist())
            self.steps_to_a_length_limit = int((self.max_total - num_tokens).min())
        rows = self.rows
        return [row for row in sorted(candidates) if rows[row].stops_at(token_ids[row])]

    def rows_filling_a_block(self, ends: list[int], scheduled_here: bool) -> list[int]:
        """Rows whose KV reached a block boundary in the step that reached ``ends`` (the oldest step not applied
        yet): only they can have a new full block to hash into the prefix cache. Known in advance for a step this
        batch scheduled; one an earlier batch of the same rows scheduled is looked at."""
        if scheduled_here:
            return self._filling.popleft()
        return list(compress(range(len(ends)), map(not_, map(mod, ends, repeat(self.block_size)))))


class KeptDecodeBatch:
    """When a step may come from a ``PersistentBatch`` instead of the scheduler's general path, and that batch.

    The general path notes each batch it schedules (``note_general_step``): one of single-token decodes that sample,
    over the whole running set, may be kept. While the running set stays the same (the scheduler counts its
    changes), the scheduler's next steps come from it, as long as nothing else asks the general path for a look
    (``Scheduler._schedule_kept``)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._rows: list[Request] | None = None  # the latest general batch's rows, if it may be kept
        self._rows_at = -1  # the running set's change count when they were noted
        self.batch: PersistentBatch | None = None  # dropped whenever the running set or its rows change
        self.num_steps = 0  # steps scheduled from a persistent batch
        self.last_update_kept = False  # the latest update ran in the persistent batch, and no row ended

    def note_general_step(self, requests: list[Request], out: SchedulerOutput, num_running: int,
                          running_changes: int) -> None:
        decodes_all = (self.enabled and requests and len(requests) == num_running
                       and len(out.input_token_ids) == len(requests) and all(out.sample) and not out.spec_token_ids
                       and not out.prompt_rows)
        self._rows, self._rows_at = (requests if decodes_all else None), running_changes

    def rows_if_unchanged(self, running_changes: int) -> list[Request] | None:
        """The kept rows, if the running set is still the one they were noted over."""
        return self._rows if self._rows_at == running_changes else None

    def schedule(self, kv: KVCacheManager) -> tuple[SchedulerOutput, list[int], PersistentBatch] | None:
        """The next step from the batch of the kept rows (built now if it was dropped), or None: the general path
        decides this step, and the rows are no longer kept."""
        batch = self.batch
        if batch is None:
            batch = self.batch = PersistentBatch(self._rows, kv)
        scheduled = batch.schedule(kv)
        if scheduled is None:
            self.batch = self._rows = None
            return None
        self.num_steps += 1
        return scheduled[0], scheduled[1], batch

    def applies_to(self, scheduled_by: PersistentBatch | None, requests: list[Request],
                   token_ids: list[int | None]) -> bool:
        """Whether a step's results apply in the current batch: the step came from a persistent batch of these very
        rows (this one, or one rebuilt from the same rows after a general step: it mirrors the requests either way),
        and every row sampled."""
        batch = self.batch
        return (scheduled_by is not None and batch is not None and batch.rows is requests
                and None not in token_ids)

    def apply(self, ends: list[int], token_ids: list[int], scheduled_here: bool) -> tuple[list[Request], list[int]]:
        """Apply a step's tokens in the batch (each row got one): the requests that ended, and the rows whose KV
        filled a block (for the prefix cache)."""
        batch = self.batch
        finished = [batch.rows[row] for row in batch.apply(token_ids)]
        filling = batch.rows_filling_a_block(ends, scheduled_here)  # (taken either way: the batch counts steps)
        self.last_update_kept = not finished
        return finished, filling
