"""A request as the engine sees it: tokens, progress, KV blocks, and timing."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from inflight.engine.block_hash import long_rope_root, request_salt, salted_root
from inflight.engine.outputs import FinishReason, RequestMetrics
from inflight.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from inflight.engine.prompt_outputs import PromptOutput
    from inflight.engine.sampler import TokenLogprobs

_arrival_counter = itertools.count()


_MASK64 = (1 << 64) - 1


def sampling_seed(seed: int, index: int, position: int) -> int:
    """The seed of the draw for output token ``position`` of choice ``index`` of a request seeded ``seed``.

    A function of the three, not a generator's running state: the draw does not depend on who shares the batch,
    nor on where the earlier tokens were drawn, so a sequence continued on another engine (``Continuation``)
    draws what the first would have. (splitmix64's finaliser over the three mixed together.)"""
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + position * 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, index: int, position: int) -> float:
    """The uniform in [0, 1) of that draw (``sampling_seed``'s top 24 bits: exact in float32)."""
    return (sampling_seed(seed, index, position) >> 40) * 2.0 ** -24


@dataclass(frozen=True)
class Continuation:
    """A sequence to be continued exactly where it stopped (on another engine, whose replica was lost or drained):
    the tokens it generated so far and how many characters of their text the caller was already sent (text held
    back for a possible stop string was not). The continued sequence counts those tokens as its output (against
    ``max_tokens``, ``min_tokens``, penalties, a grammar, stop strings), recomputes their KV with the prompt's,
    and emits only what follows."""

    token_ids: tuple[int, ...]
    text_len: int = 0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """Engine-side state of one sequence.

    The single scheduling rule works on two numbers: ``num_computed_tokens`` (tokens whose KV is
    in the cache) catches up with ``num_tokens`` (prompt + generated). A fresh prompt, a chunked
    prefill, a decode and a recompute after preemption are all the same case.
    """

    __slots__ = (
        # Written for every row of every step (the persistent batch's setattrs): first, so that they share the
        # object's first cache line. A step that comes after the device's 8 ms finds little in the caches.
        "num_computed_tokens", "num_pending_tokens", "sent_token_len", "output_token_ids", "all_token_ids",
        "status",
        "request_id", "parent_id", "index", "prompt", "prompt_token_ids", "params", "priority", "arrival_order",
        "finish_reason", "stop_reason", "metrics", "deadline", "max_total_tokens",
        "eos_token_ids", "stop_ids", "continued_text_len", "logprobs", "reports_at_end",
        "static_padding", "swapped_blocks", "aged", "prompt_logprobs", "pool", "pooled_sum",
        "has_prompt_work", "sent_first_output", "cache_root",
        "spec_token_ids", "spec_state", "spec_acceptance", "long_rope",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        prompt: str | None = None,
        priority: int = 0,
        parent_id: str | None = None,
        index: int = 0,
        arrival_time: float | None = None,
        pool: bool = False,
        continuation: Continuation | None = None,
    ) -> None:
        self.request_id = request_id
        self.parent_id = parent_id if parent_id is not None else request_id
        self.index = index
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.arrival_order = next(_arrival_counter)
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0  # sampled by scheduled steps, not yet appended (async scheduling: up to 1)
        self.cache_root = salted_root(request_salt(params.cache_salt, params.tenant))  # prefix-cache hashes start here
        self.long_rope = False  # a LongRoPE model's sequence past its original length: rotated long (models/rope.py)
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        now = time.time() if arrival_time is None else arrival_time
        self.metrics = RequestMetrics(arrival_time=now)
        self.deadline = now + params.timeout_s if params.timeout_s is not None else None
        max_new = params.max_tokens if params.max_tokens is not None else max_model_len
        self.max_total_tokens = min(len(prompt_token_ids) + max_new, max_model_len)
        self.eos_token_ids = eos_token_ids
        # every token id that can end it (eos unless ignored, its stop tokens): one membership test per token
        self.stop_ids = frozenset(params.stop_token_ids).union(() if params.ignore_eos else eos_token_ids)
        # What the core has reported of it (LLMEngine.core_step): the output tokens, the prompt's outputs (in its
        # first report); the sampled tokens' raw logprobs wait here until reported (text is the front end's:
        # engine.output_processor).
        self.sent_token_len = 0
        self.sent_first_output = False
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.continued_text_len = 0  # characters of text a continued sequence's caller was already sent
        # Its front end needs its tokens only at its end: it shows nothing before, and no stop string may end it.
        self.reports_at_end = params.output_kind == "final_only" and not params.stop
        self.static_padding = False  # static mode: finished, but still holds its slot until the batch ends
        self.swapped_blocks: list[int] | None = None  # preempted by swapping: its KV's host blocks, in order
        self.aged = False  # waited max_queue_wait_s before its first admission: served first from then on
        # Prompt outputs, filled chunk by chunk as the prompt is computed: raw logprobs of prompt positions
        # 1.. (position 0 has none, hence the leading None), and for an embedding request (``pool``, prefill-only)
        # the sum of the final-norm hidden states of the positions computed so far.
        self.prompt_logprobs: list[TokenLogprobs | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.pool = pool
        self.pooled_sum: torch.Tensor | None = None  # [hidden] float32, on the host
        # Whether the scheduler must look at this request's prompt chunks at all (the common request: never).
        self.has_prompt_work = self.prompt_logprobs is not None or pool or self.prefill_only
        # Speculative decoding (engine.speculative): this step's proposed tokens, the proposer's own state (e.g.
        # n-gram lookup's token bytes) and the request's acceptance so far as (accepted, tried), decayed.
        self.spec_token_ids: list[int] | tuple = ()
        self.spec_state = None
        self.spec_acceptance: tuple[float, float] | None = None
        if continuation is not None:  # its earlier tokens count as output, were sent, and are computed again
            self.output_token_ids = list(continuation.token_ids)
            self.all_token_ids.extend(continuation.token_ids)
            self.sent_token_len = len(continuation.token_ids)
            self.continued_text_len = continuation.text_len

    def __getstate__(self) -> dict:
        """A request crosses to the engine's process before it runs (engine_core)."""
        return {name: getattr(self, name) for name in self.__slots__ if hasattr(self, name)}

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, value)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def rotate_long(self) -> None:
        """From now on its KV is rotated by LongRoPE's long factors: a prefix cache of its own (such KV is not a
        short sequence's)."""
        self.long_rope = True
        self.cache_root = long_rope_root(self.cache_root)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def prefill_only(self) -> bool:
        """Generates nothing: done once its prompt is computed (scoring, embedding)."""
        return self.max_total_tokens == self.num_prompt_tokens

    def needs_prompt_outputs(self) -> bool:
        """Its next chunk must hand back prompt logprobs or pooled hidden states (so no prefix-cache hit)."""
        if self.pool:
            return True
        logprobs = self.prompt_logprobs
        return logprobs is not None and len(logprobs) < len(self.prompt_token_ids)

    def restart_prompt_outputs(self) -> None:
        """Preempted for recomputation: the prompt is computed again from position 0, so unfinished prompt
        outputs start over (finished prompt logprobs stay: they are not computed again)."""
        if self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids):
            self.prompt_logprobs = [None]
        self.pooled_sum = None

    def add_prompt_outputs(self, start: int, output: PromptOutput) -> None:
        """A prompt chunk from position ``start``: its prompt tokens' raw logprobs and its pooled hidden states."""
        if output.logprobs is not None:
            assert len(self.prompt_logprobs) == start + 1, "prompt logprobs must arrive chunk after chunk"
            self.prompt_logprobs.extend(output.logprobs)
        if output.pooled_sum is not None:
            pooled = self.pooled_sum
            self.pooled_sum = output.pooled_sum if pooled is None else pooled + output.pooled_sum

    def append_token(self, token_id: int) -> bool:
        """Add a sampled token and apply the token-level stop rules; True if the request ended.

        One method, not two: the scheduler calls it for every row of every step."""
        output_token_ids, all_token_ids = self.output_token_ids, self.all_token_ids
        output_token_ids.append(token_id)
        all_token_ids.append(token_id)
        if token_id in self.stop_ids or len(all_token_ids) >= self.max_total_tokens:  # the usual: neither
            return self.stops_at(token_id)
        return False

    def stops_at(self, token_id: int) -> bool:
        """``append_token``'s stop rules for ``token_id``, already appended as the last token: True (and the
        reason set) if it ends the request. What a persistent batch runs for the rows its arrays flag."""
        if token_id in self.stop_ids and len(self.output_token_ids) >= self.params.min_tokens:
            params = self.params
            # eos first: a token that is both reports no stop token, as before
            self.finish_reason = "stop"
            self.stop_reason = None if not params.ignore_eos and token_id in self.eos_token_ids else token_id
            return True
        if len(self.all_token_ids) >= self.max_total_tokens:
            self.finish_reason = "length"
            return True
        return False

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
