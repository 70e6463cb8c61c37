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
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING

import numpy as np

from engine.scheduler_output import PLACEHOLDER_TOKEN_ID, SchedulerOutput

if TYPE_CHECKING:
    from engine.block_pool import KVCacheManager
    from engine.request import Request

_ID, _COMPUTED, _PENDING = attrgetter("request_id"), attrgetter("num_computed_tokens"), attrgetter("num_pending_tokens")
_ALL, _OUTPUT, _STOP_IDS = attrgetter("all_token_ids"), attrgetter("output_token_ids"), attrgetter("stop_ids")
_MAX_TOTAL, _PARAMS, _LAST = attrgetter("max_total_tokens"), attrgetter("params"), itemgetter(-1)


def _consume(iterator) -> None:
    deque(iterator, maxlen=0)  # runs a map of side effects to its end, in C


def _array(values, count: int) -> np.ndarray:
    return np.fromiter(values, dtype=np.int64, count=count)


class PersistentBatch:
    """The running requests, all decoding one token a step, in row order.

    ``rows`` must be the whole running set, each row's request with no prompt work, no logprobs, nothing
    speculative and not static padding: ``Scheduler`` keeps one only then (``Scheduler._steady_candidate``).
    """

    def __init__(self, rows: list[Request], kv: KVCacheManager) -> None:
        count = len(rows)
        self.rows = rows
        self.request_ids: list[str] = list(map(_ID, rows))
        # the requests' live tables: allocating grows them in place, so the batch sees new blocks without a copy
        self.tables: list[list[int]] = list(map(kv.block_tables.__getitem__, self.request_ids))
        self.block_size = kv.block_size
        self.all_lists: list[list[int]] = list(map(_ALL, rows))
        self.output_lists: list[list[int]] = list(map(_OUTPUT, rows))
        self.computed = _array(map(_COMPUTED, rows), count)
        self.pending = _array(map(_PENDING, rows), count)
        self.num_tokens = _array(map(len, self.all_lists), count)
        self.num_outputs = _array(map(len, self.output_lists), count)
        self.max_total = _array(map(_MAX_TOTAL, rows), count)
        self.capacity = _array(map(len, self.tables), count) * self.block_size
        self.params = list(map(_PARAMS, rows))  # what the sampler needs of each row: fixed for a request's life
        self.stop_ids: list[frozenset[int]] = list(map(_STOP_IDS, rows))
        # When every row stops on the same tokens (the usual: the model's eos, or nothing), one set to test.
        shared = self.stop_ids[0] if count and self.stop_ids.count(self.stop_ids[0]) == count else None
        self.shared_stop_ids: frozenset[int] | None = shared
        # Steps until the first row reaches its length limit: counted down, so most steps compare no arrays.
        self.steps_to_a_length_limit = int((self.max_total - self.num_tokens).min()) if count else 0

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def schedule(self, kv: KVCacheManager) -> tuple[SchedulerOutput, list[int]] | None:
        """The next step: every row decodes its next token. None if that is not this step's batch (a row waits for
        its last token, which is in flight, or has more than one token to compute) or a row's next block cannot
        be had: the general path then decides, with preemption. Else the batch and the KV length each row reaches.
        """
        computed, pending = self.computed, self.pending
        known = self.num_tokens + pending
        if not np.array_equal(known - computed, np.ones_like(computed)):
            return None
        if pending.any():
            if not pending.all() or (known >= self.max_total).any():
                return None  # mixed rows, or a row's last token is in flight (it ends when that lands)
            inputs = [PLACEHOLDER_TOKEN_ID] * self.num_rows  # the in-flight step's samples: the runner puts them in
            placeholder_rows = list(range(self.num_rows))
        else:
            inputs = list(map(_LAST, self.all_lists))  # the token at position ``computed`` is each row's last
            placeholder_rows = []
        tables, block_size, request_ids = self.tables, self.block_size, self.request_ids
        for row in np.flatnonzero(computed >= self.capacity).tolist():  # rows whose blocks are full: ~1 in 16
            if not kv.allocate(request_ids[row], int(computed[row]) + 1):
                return None
            self.capacity[row] = len(tables[row]) * block_size
        count = self.num_rows
        out = SchedulerOutput(
            request_ids=list(request_ids), input_token_ids=inputs, query_lens=[1] * count,
            start_positions=computed.tolist(), block_tables=list(tables), sample=[True] * count,
            padding=[False] * count, placeholder_rows=placeholder_rows)
        computed += 1
        pending += 1
        ends = computed.tolist()
        _consume(map(setattr, self.rows, repeat("num_computed_tokens"), ends))
        _consume(map(setattr, self.rows, repeat("num_pending_tokens"), pending.tolist()))
        return out, ends

    def sampled_output_counts(self) -> list[int]:
        """Per row, the output tokens before the one this step samples (in-flight ones included)."""
        return (self.num_outputs + self.pending - 1).tolist()

    def apply(self, token_ids: list[int]) -> list[int]:
        """Append each row's sampled token; returns the rows whose token ended their request (by the same rules
        and with the same reasons as ``Request.append_token``, which each such row runs again to decide)."""
        self.pending -= 1
        self.num_tokens += 1
        self.num_outputs += 1
        _consume(map(list.append, self.output_lists, token_ids))
        _consume(map(list.append, self.all_lists, token_ids))
        _consume(map(setattr, self.rows, repeat("num_pending_tokens"), self.pending.tolist()))
        # Which rows to look at: a token in the row's stop set (C loops over set lookups; numpy's isin costs more
        # at these sizes), or a row at its length limit (only once the countdown says one may be).
        shared = self.shared_stop_ids
        if shared is not None:
            hit = list(map(shared.__contains__, token_ids)) if shared else None
        else:
            hit = list(map(frozenset.__contains__, self.stop_ids, token_ids))
        candidates = set(compress(range(self.num_rows), hit)) if hit is not None and True in hit else set()
        self.steps_to_a_length_limit -= 1
        if self.steps_to_a_length_limit <= 0:
            candidates.update(np.flatnonzero(self.num_tokens >= self.max_total).tolist())
            self.steps_to_a_length_limit = int((self.max_total - self.num_tokens).min())
        rows = self.rows
        return [row for row in sorted(candidates) if rows[row].stops_at(token_ids[row])]

    def rows_filling_a_block(self, ends: list[int]) -> list[int]:
        """Rows whose KV reached a block boundary in the step that reached ``ends``: only they can have a new full
        block to hash into the prefix cache."""
        return list(compress(range(len(ends)), (np.asarray(ends) % self.block_size == 0).tolist()))
