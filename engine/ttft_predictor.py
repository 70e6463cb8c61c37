"""Predict a request's time to first token from the work queued ahead of it and measured step costs.

First in steps and tokens, from the queue:

1. a batch slot: if the slots are full once the requests ranked ahead of it are counted, the request
   waits for that many running requests to end, one step per output token. They end in the order of
   their remaining output (the engine's estimate: the max_tokens bound, open-ended requests capped at
   twice the mean output seen), and each further round of every slot lasts a typical output (the engine
   passes the mean output of finished and running requests). Rounds fit outputs of similar lengths; with
   a long tail, short requests cycle through a few slots while long ones hold the rest, and this over-counts;
2. the prompts ahead of it go through the token budget left over by the decodes, chunk by chunk, in the
   same steps as 1, so the longer of the two counts; then its own prompt's chunks.

Then in seconds: a step costs (a decode step) + (time per prefill token) x (its prefill tokens), and every
prompt token ahead, then its own, is computed in one of those steps, so

    TTFT = steps x decode step + (prompt tokens ahead + own prompt tokens) x time per prefill token.

Both rates are measured from the engine's own steps, so they follow the machine, the model and the load
without configuration, and they are averaged so that one slow step does not move them much: on a shared
machine a step now and then takes 10-100x the usual (another process had the core), and the slot wait
multiplies the decode step by hundreds of steps.

The engine uses it at admission: a request whose deadline is sooner than the prediction is refused
at once (HTTP 429 with a ``Retry-After``) instead of timing out after occupying the queue. It predicts
from a ``QueueView``, the queue as plain data: the engine takes one when a request is enqueued, and the
async engine's step thread publishes one between steps, so that a request can be refused when it is
submitted rather than when the step under way ends (a long prefill step can outlast a short deadline).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Iterable, NamedTuple

from inflight.engine.outputs import DeadlineUnmeetableError
from inflight.engine.scheduling_policy import Rank, fresh_rank

if TYPE_CHECKING:
    from inflight.engine.config import EngineConfig
    from inflight.engine.request import Request
    from inflight.engine.scheduler import Scheduler

MIN_OBSERVATIONS = 8  # steps seen before predictions are trusted
DECODE_DECAY = 0.98  # the decode step is averaged over ~50 decode-only steps
PREFILL_DECAY = 0.9  # the prefill cost over ~10 steps with prefill (they are rarer)
MAX_STEP_RATIO = 5.0  # a step counts at most this many times the current average


class TTFTPredictor:
    """Two measured rates: the time of a step with no prefill tokens (decodes only), a moving average of
    such steps; and the extra time per prefill token of the other steps, as the ratio of moving sums
    (extra seconds over the decode step / prefill tokens), so a step weighs by its tokens.

    A step counts at most ``MAX_STEP_RATIO`` x the current average (one stall moves the average by 8%, a
    lasting change comes through in tens of steps), and the first step of each kind not at all (it pays
    one-time costs: allocation, kernel selection). (A least-squares fit of base + per token + per row was
    tried first: with mixed steps dominating under load its terms traded off and predictions drifted by
    20x. An average of per-step ratios with a ~20-step window, next, followed stalls: x10 over-predictions.)
    """

    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.decode_step_s: float | None = None
        self.per_prefill_token_s: float | None = None
        self.num_observations = 0
        self._prefill_extra_s = 0.0  # moving sums whose ratio is per_prefill_token_s
        self._prefill_tokens = 0.0
        self._seen_decode = self._seen_prefill = False

    @property
    def ready(self) -> bool:
        return (self.num_observations >= MIN_OBSERVATIONS and self.decode_step_s is not None
                and self.per_prefill_token_s is not None)

    def observe(self, seconds: float, num_prefill_tokens: int, num_decode_rows: int = 0) -> None:
        """One engine step's wall time. Decode rows are part of the decode step (their count moves slowly
        compared with the average)."""
        self.num_observations += 1
        if num_prefill_tokens == 0:
            average = self.decode_step_s
            if average is None:
                if self._seen_decode:
                    self.decode_step_s = seconds
                self._seen_decode = True
                return
            seconds = min(seconds, MAX_STEP_RATIO * average)
            self.decode_step_s = DECODE_DECAY * average + (1 - DECODE_DECAY) * seconds
            return
        if not self._seen_prefill:
            self._seen_prefill = True
            return
        extra = max(0.0, seconds - (self.decode_step_s or 0.0))
        if self.per_prefill_token_s is not None:
            extra = min(extra, MAX_STEP_RATIO * self.per_prefill_token_s * num_prefill_tokens)
        self._prefill_extra_s = PREFILL_DECAY * self._prefill_extra_s + extra
        self._prefill_tokens = PREFILL_DECAY * self._prefill_tokens + num_prefill_tokens
        self.per_prefill_token_s = self._prefill_extra_s / self._prefill_tokens

    def slot_wait_steps(self, num_ahead: int, running_remaining: list[int], typical_output: int | None = None) -> int:
        """Steps until a slot is free for a request behind ``num_ahead`` waiting ones, while requests with
        ``running_remaining`` output tokens left hold slots. ``typical_output``: how long a request that has
        just been admitted keeps its slot (default: the longest running remainder)."""
        must_end = num_ahead + 1 - (self.max_num_seqs - len(running_remaining))  # running requests that must end
        if must_end <= 0 or not running_remaining:
            return 0
        ordered = sorted(running_remaining)
        rounds, index = divmod(must_end - 1, len(ordered))  # each round frees every slot once more
        per_round = typical_output if typical_output is not None else ordered[-1]
        return ordered[index] + rounds * per_round

    def prefill_steps(self, tokens: int, num_decode_rows: int) -> int:
        """Steps to push ``tokens`` of prompt through the budget left next to ``num_decode_rows`` decodes."""
        per_step = max(1, self.max_num_batched_tokens - min(num_decode_rows, self.max_num_seqs))
        return -(-max(0, tokens) // per_step)

    def predict(self, own_prompt_tokens: int, tokens_ahead: int, num_ahead: int,
                running_remaining: list[int], typical_output: int | None = None) -> float:
        """Seconds until the first token of a request with ``own_prompt_tokens`` left to compute, behind
        ``num_ahead`` waiting requests and ``tokens_ahead`` uncomputed prompt tokens (see the module
        docstring; the arguments are those of ``slot_wait_steps``)."""
        num_rows = len(running_remaining)
        steps = (max(self.slot_wait_steps(num_ahead, running_remaining, typical_output),
                     self.prefill_steps(tokens_ahead, num_rows))
                 + self.prefill_steps(own_prompt_tokens, num_rows))
        return (steps * (self.decode_step_s or 0.0)
                + (max(0, tokens_ahead) + own_prompt_tokens) * (self.per_prefill_token_s or 0.0))


class Prediction(NamedTuple):
    seconds: float
    num_ahead: int  # waiting requests admitted before this one
    tokens_ahead: int  # prompt tokens computed before its own


@dataclasses.dataclass(frozen=True)
class QueueView:
    """What admission needs to predict a newcomer's first token, as plain data that another thread may read
    while steps run: each waiting request's rank and prompt tokens left to compute, the prompt tokens the
    running requests still have to prefill, their expected remaining outputs, a typical output length, and
    a copy of the predictor's rates, all as of ``taken_at`` (``time.time()``)."""

    taken_at: float
    waiting: tuple[tuple[Rank, int], ...]
    prefilling: int
    remaining: tuple[int, ...]
    typical_output: int | None
    priority_policy: bool  # ranks use priorities (else arrival order alone)
    rates: TTFTPredictor

    @classmethod
    def take(cls, predictor: TTFTPredictor, taken_at: float, waiting: Iterable[tuple[Rank, int]], prefilling: int,
             remaining: Iterable[int], typical_output: int | None, priority_policy: bool) -> "QueueView":
        return cls(taken_at, tuple(waiting), prefilling, tuple(remaining), typical_output, priority_policy,
                   copy.copy(predictor))

    def newcomer_rank(self, priority: int, arrival_order: int) -> Rank:
        """The rank of a request that has not waited long enough to age (Scheduler.rank)."""
        return fresh_rank(priority, arrival_order, self.priority_policy)

    def predict(self, own_prompt_tokens: int, rank: Rank, num_siblings: int = 1, now: float | None = None,
                also_ahead: Iterable[tuple[Rank, int]] = ()) -> Prediction:
        """The first token of a request of ``rank`` with ``own_prompt_tokens`` to compute, admitted with
        ``num_siblings - 1`` copies (n > 1: the last copy's first token is the request's), behind the waiting
        requests that rank before it, here and in ``also_ahead`` (requests submitted since the view was
        taken). At ``now`` later than the view, the steps run since are taken off."""
        num_ahead = tokens_ahead = 0
        for other_rank, tokens in (*self.waiting, *also_ahead):
            if other_rank < rank:
                num_ahead += 1
                tokens_ahead += tokens
        tokens_ahead += self.prefilling
        seconds = self.rates.predict(own_prompt_tokens * num_siblings, tokens_ahead, num_ahead + num_siblings - 1,
                                     list(self.remaining), self.typical_output)
        if now is not None:
            seconds = max(0.0, seconds - max(0.0, now - self.taken_at))
        return Prediction(seconds, num_ahead, tokens_ahead)


def predicts_for(config: "EngineConfig", request: "Request") -> bool:
    """Whether admission predicts this request's first token: with continuous batching (the static scheduler
    admits whole batches), and not for the prefill lane's requests (they do not wait behind the scheduler's
    queue, and their own deadline ends them)."""
    return config.batching == "continuous" and not (config.prefill_lane and request.prefill_only)


def check_deadline(requests: list["Request"], view: QueueView | None, now: float | None = None,
                   also_ahead: Iterable[tuple[Rank, int]] = ()) -> float | None:
    """Predict the first token of ``requests`` (one request's ``n`` sequences) from ``view`` and refuse them
    (``DeadlineUnmeetableError``) if their deadline is sooner. Returns the prediction (None without a view).
    Reads only its arguments, so any thread may call it: ``now`` (default: when the view was taken) and the
    requests submitted since the view (``also_ahead``) for a view taken earlier."""
    if view is None:
        return None
    first = requests[0]
    prediction = view.predict(first.num_tokens, view.newcomer_rank(first.priority, first.arrival_order),
                              len(requests), now, also_ahead)
    now = view.taken_at if now is None else now
    if first.deadline is not None and first.params.reject_unmeetable_deadline and now + prediction.seconds > first.deadline:
        allowed = first.deadline - now
        raise DeadlineUnmeetableError(
            f"the deadline ({allowed:.3f} s from now) cannot be met: the predicted time to first token is "
            f"{prediction.seconds:.3f} s with {prediction.num_ahead} requests ({prediction.tokens_ahead} tokens) "
            f"queued ahead", predicted_ttft_s=prediction.seconds, retry_after_s=prediction.seconds - max(0.0, allowed))
    return prediction.seconds


class OutputLengths:
    """The output lengths of finished requests, for what admission expects of running ones."""

    def __init__(self) -> None:
        self.total = 0
        self.count = 0

    def record(self, num_output_tokens: int) -> None:
        self.total += num_output_tokens
        self.count += 1

    def expected_remaining(self, request: Request) -> int:
        """Output tokens a running request will still produce: its max_tokens bound, or, once requests have
        finished, no more than twice the mean output length seen (a request without max_tokens may run to
        max_model_len, but few do, and assuming it would refuse requests that would have made it)."""
        bound = request.max_total_tokens - request.num_tokens
        if self.count < 5:
            return bound
        typical = 2 * self.total / self.count
        return max(1, min(bound, int(typical) - request.num_output_tokens))


def take_queue_view(predictor: TTFTPredictor | None, scheduler: Scheduler, lengths: OutputLengths, now: float,
                    priority_policy: bool) -> QueueView | None:
    """The scheduler's queue as admission sees it, or None while the predictor has too few steps to trust. From
    the thread that runs the scheduler only: it reads its queues."""
    if predictor is None or not predictor.ready:
        return None
    running = scheduler.running
    remaining = [lengths.expected_remaining(r) for r in running]
    # How long a newly admitted request holds its slot: the mean output length of the finished requests and the
    # running ones (their expected length). Finished ones alone are a handful on a cold start: their mean was 30%
    # off and each round of slots in a deep queue repeated it (slot waits 1.4x too long).
    num_lengths = lengths.count + len(running)
    typical = ((lengths.total + sum(remaining) + sum(len(r.output_token_ids) for r in running))
               // num_lengths if num_lengths else None)
    # Prompt chunks still to come for running requests take the budget before any waiting request's.
    prefilling = sum(left for r in running if (left := len(r.all_token_ids) - r.num_computed_tokens) > 1)
    waiting = ((scheduler.rank(r, now), r.num_tokens - r.num_computed_tokens) for r in scheduler.waiting)
    return QueueView.take(predictor, now, waiting, prefilling, remaining, typical, priority_policy=priority_policy)
