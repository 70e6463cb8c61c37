"""What the scheduler hands the model runner each step, and what a step observer sees: plain data, no live state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from inflight.engine.scheduler import Scheduler


class PromptRow(NamedTuple):
    """What a prompt chunk hands back besides (or instead of) a sampled token."""

    num_top_logprobs: int | None  # logprobs of the prompt tokens the chunk predicts, with this many alternatives
    pool: bool  # the sum of the chunk's final-norm hidden states (an embedding request)
    next_token_id: int | None  # the prompt token after the chunk, which its last position predicts; None at the end


PLACEHOLDER_TOKEN_ID = -1


@dataclass
class SchedulerOutput:
    """One step's batch.

    Row i is request ``request_ids[i]``: it feeds ``query_lens[i]`` tokens starting at position
    ``start_positions[i]`` (so its KV length after the step is start + query_len). ``sample[i]``
    says whether the row's last token produces a new token. Static-mode padding rows
    (``padding[i]``) are finished requests that still occupy their slot: they are computed, their
    KV is not written and their sample is thrown away, exactly the waste static batching pays.
    """

    request_ids: list[str] = field(default_factory=list)
    input_token_ids: list[int] = field(default_factory=list)  # all rows, flattened
    query_lens: list[int] = field(default_factory=list)
    start_positions: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)  # copies, as of scheduling: never the live lists
    # The rows' window tables (block_pool.py: a model's sliding-window layers' KV), or None: no such layers apart
    window_tables: list[list[int]] | None = None
    # A LongRoPE model's rows: whether each request's prompt is rotated long throughout (engine/models/rope.py)
    long_rope: list[bool] | None = None
    sample: list[bool] = field(default_factory=list)
    padding: list[bool] = field(default_factory=list)
    # KV copies the runner makes before the forward, outs first: (device block, host block) pairs leaving
    # the device for preempted requests, then (host block, device block) pairs of resumed ones.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Rows (by index) of requests that want prompt logprobs or pooled hidden states from this chunk.
    prompt_rows: dict[int, PromptRow] = field(default_factory=dict)
    # Decode rows (by index) whose input is the token an earlier, still running step samples (async scheduling):
    # their input_token_ids entry is PLACEHOLDER_TOKEN_ID until the runner puts that token in.
    placeholder_rows: list[int] = field(default_factory=list)
    # Decode rows (by index) that verify proposed tokens (speculative decoding): the row's input is its last token
    # and then these, it samples at each of them, and the step emits the accepted ones plus one more token.
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # Requests that ended since the previous batch and had per-request state in the runner (penalty counts, a
    # grammar matcher): it can go.
    ended_ids: list[str] = field(default_factory=list)

    @property
    def num_rows(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.input_token_ids)

    @property
    def is_empty(self) -> bool:
        return not self.request_ids

    @property
    def num_spec_tokens(self) -> int:
        return sum(map(len, self.spec_token_ids.values())) if self.spec_token_ids else 0

    @property
    def num_decode_rows(self) -> int:
        """Rows that decode (one token, or one plus proposals), padding included."""
        return self.query_lens.count(1) + len(self.spec_token_ids)


@dataclass
class PrefillBatch:
    """One prefill-only lane batch: whole prompts, each from position 0, computed without the KV cache."""

    request_ids: list[str]
    token_ids: list[list[int]]
    rows: list[PromptRow]  # what each prompt hands back (its ``next_token_id`` is None: the prompt is whole)

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.token_ids))


@dataclass(frozen=True)
class StepRecord:
    """One step as an observer (a benchmark, a tracer) sees it: the batch and the engine state it ran in.

    Taken right after scheduling: ``running_ids`` are the sequences holding a batch slot, in the
    scheduler's order (static mode: finished members kept as padding included), and
    ``kv_tokens_used`` counts the KV of this step's new tokens as used. ``parent_ids`` maps each of
    those sequences to the request id the caller chose. ``duration_s`` is the whole step's wall time.
    """

    step_index: int
    batch: SchedulerOutput
    running_ids: list[str]
    parent_ids: dict[str, str]
    num_waiting: int
    kv_blocks_used: int
    kv_tokens_used: int
    duration_s: float = 0.0

    @classmethod
    def take(cls, step_index: int, batch: SchedulerOutput, scheduler: Scheduler) -> StepRecord:
        """The state step ``step_index`` runs in, taken before the runner and ``update`` change it."""
        running = scheduler.running
        return cls(step_index, batch, [r.request_id for r in running], {r.request_id: r.parent_id for r in running},
                   len(scheduler.waiting), scheduler.kv.pool.num_used,
                   scheduler.kv_stats().num_tokens_used)  # the step's new tokens count as computed
