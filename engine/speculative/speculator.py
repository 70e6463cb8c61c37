"""Who gets how many proposed tokens each step, and what it cost: the adaptive part of speculative decoding.

A proposed token is worth computing when it is likely enough to be accepted for what it costs. Two measured
things decide it:

- each request's acceptance rate ``alpha`` (accepted over tried, a moving average: a request that copies its
  prompt accepts most, one that does not accepts little): its j-th proposed token is accepted, with every one
  before it, with probability ``alpha ** j``;
- the step-cost model (``StepCostModel``): a decode step of ``rows`` rows takes ``base + per_row * rows``
  seconds and each proposed token adds ``per_token``, fitted to the engine's own timed steps.

A step without speculation makes ``rows / step_s`` tokens per second. One more proposed token adds
``alpha ** j`` expected tokens for ``per_token`` seconds, so it pays while ``alpha ** j >= rows * per_token /
step_s`` (the threshold, ``theta``, never below ``MIN_THRESHOLD``). At low load theta is small and rows take
every proposal they have; as rows grow it rises, and where it reaches 1 nothing is worth proposing: speculation
switches off by itself, with no fixed batch-size limit (``disable_above_batch_size`` adds one if wanted). Every 16th step proposes nothing (so
the model sees what a plain step costs), and a request whose rate fell below the threshold tries one token every
16 steps (so its rate can recover when its output starts repeating)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from inflight.engine.speculative.config import SpeculativeConfig
from inflight.engine.speculative.proposers import Proposer, make_proposer

if TYPE_CHECKING:
    from inflight.engine.config import EngineConfig
    from inflight.engine.kv_budget import SharedBudget
    from inflight.engine.request import Request

EXPLORE_EVERY = 16  # steps: one plain step, and one probe of the rows left out, per this many
ACCEPTANCE_DECAY = 0.9  # a request's acceptance rate follows its last ~10 verified steps
PRIOR = (1.0, 2.0)  # (accepted, tried) before a request's first verified step: alpha 0.5
COST_DECAY = 0.97  # the step-cost fit follows the last ~30 steps
MIN_PLAIN_STEPS = 2  # plain steps and ...
MIN_SPEC_STEPS = 4  # ... speculative steps seen before the cost model is trusted
# The least acceptance a proposed token needs whatever the cost model says (before it is trusted, or on a step that
# costs nearly nothing): one taken less than one time in ten is not worth its KV slot and bookkeeping.
MIN_THRESHOLD = 0.1


class StepCostModel:
    """Least squares, exponentially forgotten, of a step's seconds over (1, decode rows, proposed tokens), after
    taking out its prompt tokens at the engine's measured cost per prefill token."""

    def __init__(self) -> None:
        self._a = np.zeros((3, 3))
        self._b = np.zeros(3)
        self.num_plain = self.num_spec = 0

    def observe(self, seconds: float, rows: int, proposed: int) -> None:
        x = np.array([1.0, rows, proposed])
        self._a = COST_DECAY * self._a + np.outer(x, x)
        self._b = COST_DECAY * self._b + x * seconds
        if proposed:
            self.num_spec += 1
        else:
            self.num_plain += 1

    @property
    def ready(self) -> bool:
        return self.num_plain >= MIN_PLAIN_STEPS and self.num_spec >= MIN_SPEC_STEPS

    def coefficients(self) -> tuple[float, float, float]:
        """(base, per row, per proposed token) seconds; a little ridge keeps a flat direction (rows that never
        change) from blowing up."""
        w = np.linalg.solve(self._a + 1e-9 * np.eye(3), self._b)
        return float(w[0]), float(w[1]), float(w[2])

    def threshold(self, rows: int) -> float:
        """``rows * per_token / step_s``: the acceptance probability a proposed token needs to pay for itself."""
        if not self.ready or rows == 0:
            return 0.0
        base, per_row, per_token = self.coefficients()
        step_s = base + per_row * rows
        if step_s <= 0:
            return 0.0
        return max(0.0, rows * per_token / step_s)


class Speculator:
    def __init__(self, config: SpeculativeConfig, eos_token_ids: frozenset[int], draft: Proposer | None = None) -> None:
        self.config = config
        self.proposer = make_proposer(config, draft)
        self.eos_token_ids = eos_token_ids
        self.cost = StepCostModel()
        self.num_steps = 0
        self.num_proposed_tokens = 0
        self.num_accepted_tokens = 0
        self.num_spec_steps = 0  # steps that verified at least one proposed token
        self.threshold = 0.0  # the latest step's theta
        self.off_reason: str | None = None  # why the latest step proposed nothing, when it did not

    def propose(self, decoding: list["Request"]) -> None:
        """Set ``spec_token_ids`` of each decoding request (its KV is computed up to its last token) for this
        step: its proposal cut to what pays (adaptive), to its token limit and before any stop token."""
        self.num_steps += 1
        config = self.config
        for request in decoding:
            request.spec_token_ids = ()
        rows = len(decoding)
        limit = config.disable_above_batch_size
        if limit is not None and rows > limit:
            self.off_reason = f"{rows} rows decode, more than disable_above_batch_size ({limit})"
            return
        adaptive = config.adaptive
        phase = self.num_steps % EXPLORE_EVERY
        if adaptive and phase == 0:
            self.off_reason = "a plain step, for the cost model"
            return
        theta = self.threshold = max(MIN_THRESHOLD, self.cost.threshold(rows)) if adaptive else 0.0
        if theta >= 1.0:
            self.off_reason = f"the cost model says it loses at {rows} rows (threshold {theta:.2f})"
            return
        self.off_reason = None
        num_spec = config.num_speculative_tokens
        ks = []
        for request in decoding:
            k = min(num_spec, request.max_total_tokens - len(request.all_token_ids) - 1)
            if adaptive and k > 0:
                accepted, tried = request.spec_acceptance or PRIOR
                k = _worthwhile(accepted / tried, theta, k)
                if k == 0 and phase == EXPLORE_EVERY // 2:
                    k = 1  # a probe: has this request started to repeat itself?
            ks.append(k)
        for request, proposal in zip(decoding, self.proposer.propose_batch(decoding, ks)):
            if proposal:
                request.spec_token_ids = self._cut_at_stop(request, proposal)

    def forget(self, request_id: str) -> None:
        """The request ended (its proposer state outside the request goes)."""
        self.proposer.forget(request_id)

    def _cut_at_stop(self, request: "Request", proposal: list[int]) -> list[int]:
        """Proposals stop before a token that would end the request: only the last token a step emits may."""
        params = request.params
        stops = params.stop_token_ids
        eos = () if params.ignore_eos else self.eos_token_ids
        for i, token_id in enumerate(proposal):
            if token_id in eos or token_id in stops:
                return proposal[:i]
        return proposal

    def observe(self, verified: list[tuple["Request", int, int]], seconds: float, rows: int,
                prompt_tokens: int, per_prompt_token_s: float | None) -> None:
        """One computed step: (request, proposed, accepted) per row that verified proposals, the step's seconds,
        its decode rows and prompt tokens (their cost is taken out before the cost model sees the step)."""
        proposed_total = 0
        for request, proposed, accepted in verified:
            proposed_total += proposed
            self.num_accepted_tokens += accepted
            old_accepted, old_tried = request.spec_acceptance or PRIOR
            # A row that took all its proposals tried them all; one that stopped early also tried the one refused.
            request.spec_acceptance = (ACCEPTANCE_DECAY * old_accepted + accepted,
                                       ACCEPTANCE_DECAY * old_tried + accepted + (accepted < proposed))
        self.num_proposed_tokens += proposed_total
        if proposed_total:
            self.num_spec_steps += 1
        if rows == 0:
            return
        if prompt_tokens:
            if per_prompt_token_s is None:
                return  # its prompt tokens' share is unknown yet
            seconds -= prompt_tokens * per_prompt_token_s
        self.cost.observe(seconds, rows, proposed_total)

    def stats(self) -> dict:
        proposed = self.num_proposed_tokens
        per_token = self.cost.coefficients()[2] if self.cost.ready else None
        return {
            "spec_method": self.config.method,
            "spec_num_proposed_tokens": proposed,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_acceptance_rate": self.num_accepted_tokens / proposed if proposed else None,
            "spec_num_steps": self.num_spec_steps,
            "spec_threshold": self.threshold,  # acceptance a proposed token needs to pay for itself (adaptive)
            "spec_token_cost_s": per_token,  # what one proposed token adds to a step (the cost model)
            "spec_off_reason": self.off_reason,  # why the latest step proposed nothing, if it did not
        }


def _worthwhile(alpha: float, theta: float, k: int) -> int:
    """How many of ``k`` proposed tokens pay: the j-th while ``alpha ** j >= theta``."""
    if theta <= 0.0:
        return k
    chance, n = 1.0, 0
    while n < k:
        chance *= alpha
        if chance < theta:
            break
        n += 1
    return n


def draft_budget(config: EngineConfig) -> SharedBudget | None:
    """A draft model's share of the KV budget (its weights, and KV for as many tokens as the target's)."""
    from inflight.engine.device import resolve_device, resolve_dtype
    from inflight.engine.kv_budget import SharedBudget
    from inflight.engine.models.source import read_model_source

    spec = config.speculative_config
    if spec is None or spec.method != "draft":
        return None
    draft = read_model_source(spec.draft_model).config
    itemsize = resolve_dtype(config.dtype, draft.torch_dtype, resolve_device(config.device)).itemsize
    return SharedBudget(draft.num_parameters * itemsize, draft.kv_bytes_per_token(itemsize))


def make_speculator(config: EngineConfig, max_model_len: int, vocab_size: int, num_kv_blocks: int,
                    eos_token_ids: frozenset[int]) -> Speculator | None:
    """The engine's speculator, if ``speculative_config`` asks for one; a draft model's KV cache holds as many tokens
    as the target's."""
    spec = config.speculative_config
    if spec is None:
        return None
    draft = None
    if spec.method == "draft":
        from inflight.engine.speculative.draft import DraftProposer

        draft = DraftProposer(spec.draft_model, config, max_model_len, vocab_size, num_kv_blocks)
    return Speculator(spec, eos_token_ids, draft)
