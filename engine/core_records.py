"""What the engine's core reports after a step: per sequence that got tokens or ended, what is new since its last
record (``core_messages.SequenceUpdate``), or one ``PlainStep`` for a step of the persistent batch in which every
row got one token and nothing else, built by C loops (no bytecode per row).

A request's sequences remember what was reported of them (``Request.sent_token_len``, ``sent_first_output``,
the raw logprobs waiting in ``Request.logprobs``); a request reported only at its end (``reports_at_end``) gets one
record, then.
"""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter, sub
from typing import Callable

from inflight.engine.core_messages import CoreMetrics, PlainStep, Record, SequenceUpdate
from inflight.engine.persistent_batch import consume
from inflight.engine.request import Request, RequestStatus
from inflight.engine.step_launcher import Launched

_OUTPUT, _SENT_LEN, _SENT_FIRST = attrgetter("output_token_ids"), attrgetter("sent_token_len"), attrgetter("sent_first_output")
_LOGPROBS, _REPORTS_AT_END = attrgetter("logprobs"), attrgetter("reports_at_end")


class CoreRecords:
    def __init__(self) -> None:
        # the rows of the persistent batch last found to be a plain step, and their output lists
        self._plain_rows: list[Request] | None = None
        self._plain_outputs: list[list[int]] = []

    def of_touched(self, touched: dict[str, None], children_of: dict[str, list[Request]], token_time: float,
                   retire: Callable[[str], None]) -> list[Record]:
        """The records of the requests (parent ids) a step touched: per sequence, what is new since its last record.
        A request whose sequences have all ended is ``retire``d (it leaves the engine)."""
        records: list[Record] = []
        add = records.append
        finished = RequestStatus.FINISHED
        for parent in touched:
            children = children_of.get(parent)
            if children is None:  # a stop string ended it since (LLMEngine.finish_stopped)
                continue
            all_ended = True
            for child in children:
                ended = child.status is finished
                if not ended:
                    all_ended = False
                    token_ids, sent = child.output_token_ids, child.sent_token_len
                    num_tokens = len(token_ids)
                    if num_tokens == sent:
                        continue  # nothing new for it (with n > 1: a sibling advanced)
                    if child.sent_first_output and child.logprobs is None:  # the usual: new tokens, nothing else
                        child.sent_token_len = num_tokens
                        add(SequenceUpdate(child.request_id, token_ids[sent:]))
                        continue
                record = _record(child, ended, token_time)
                if record is not None:
                    add(record)
            if all_ended:
                retire(parent)
        return records

    def is_plain_step(self, rows: list[Request]) -> bool:
        """Whether ``rows``, a step of the scheduler's persistent batch in which no row ended, are the usual case
        there: each with one new token since its last record, no logprobs, past its first record, not reported only
        at its end. Checked once per batch of rows (the same list object while the running set is unchanged): what
        it checks then stays true, since every record of a step covers each of its rows."""
        if rows is self._plain_rows:
            return True
        count = len(rows)
        outputs = list(map(_OUTPUT, rows))
        if (list(map(_LOGPROBS, rows)).count(None) != count or not all(map(_SENT_FIRST, rows))
                or any(map(_REPORTS_AT_END, rows))
                or list(map(sub, map(len, outputs), map(_SENT_LEN, rows))).count(1) != count):
            return False
        self._plain_rows, self._plain_outputs = rows, outputs
        return True

    def of_plain_step(self, step: Launched) -> list[Record]:
        """``of_touched`` for a plain step: one record for all its rows, their ids and their one new token each."""
        consume(map(setattr, step.rows, repeat("sent_token_len"), map(len, self._plain_outputs)))
        return [PlainStep(step.batch.request_ids, list(step.result()[0].sampled_token_ids))]


def _record(child: Request, ended: bool, token_time: float) -> SequenceUpdate | None:
    """The general case: a sequence's first record (the prompt's outputs, the metrics), its last (its end, the
    metrics, an embedding), one with logprobs; None while a request reports only at its end."""
    token_ids, metrics = child.output_token_ids, child.metrics
    if token_ids and metrics.first_token_time is None:
        metrics.first_token_time = token_time
    if not ended and child.reports_at_end:
        return None
    new = token_ids[child.sent_token_len:]
    child.sent_token_len = len(token_ids)
    logprobs = child.logprobs
    if logprobs:
        child.logprobs = []
    first = not child.sent_first_output
    child.sent_first_output = True
    m = None
    if (first or ended) and child.index == 0:
        m = CoreMetrics(metrics.first_scheduled_time, metrics.first_token_time, metrics.finished_time,
                        metrics.num_preemptions, metrics.predicted_ttft_s)
    embedding = None
    if ended and child.pool and child.pooled_sum is not None:
        embedding = (child.pooled_sum / child.num_prompt_tokens).tolist()
    return SequenceUpdate(child.request_id, new, child.finish_reason if ended else None, child.stop_reason,
                          logprobs or None, child.prompt_logprobs if first else None, embedding, m)
