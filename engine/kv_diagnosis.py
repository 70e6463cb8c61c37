"""Why KV utilisation is low: the seed's advice, applied by the engine to its own recent steps.

When token-level KV utilisation stays below 60% while requests wait, memory is not the limit, something
else is: blocks held but not filled (fragmentation), too few batch slots, or too small a token budget.
``diagnose_kv`` names the most frequent cause over a window of steps. The engine runs it on a sample of
its recent steps and logs a warning (and serving sets a gauge); the benchmarks run it on whole runs.
Pure functions on plain numbers, tested on hand-made traces.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

logger = logging.getLogger("inflight.engine.llm_engine")  # (where operators have always found this warning)

KV_UTILISATION_THRESHOLD = 0.6  # the seed's advice: below this, look for fragmentation or a small config
MIN_WAITING_SHARE = 0.1  # a queue in under this share of the steps is a passing burst, not a state to diagnose


@dataclass(frozen=True)
class EngineLimits:
    """The configuration a step ran under: what occupancy and utilisation are fractions of."""

    batching: str
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_blocks_total: int
    block_size: int

    @property
    def kv_tokens_total(self) -> int:
        return self.kv_blocks_total * self.block_size


@dataclass(frozen=True)
class StepSample:
    """One engine step in numbers. A row of more than one token is a prefill chunk; a one-token row computes
    a generated token (a one-token prefill chunk is counted with them: it costs the same)."""

    duration_s: float
    num_prefill_tokens: int
    num_decode_rows: int
    num_padding_rows: int
    num_running: int  # requests holding a batch slot
    num_waiting: int
    kv_blocks_used: int
    kv_tokens_used: int
    num_spec_tokens: int = 0  # proposed tokens decode rows verified (speculative decoding)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_rows + self.num_padding_rows + self.num_spec_tokens

    @property
    def kind(self) -> str:
        if self.num_prefill_tokens and self.num_decode_rows:
            return "mixed"
        return "prefill" if self.num_prefill_tokens else "decode"


CAUSES = {
    "fragmentation": "blocks are held but not filled (fragmentation): {fill:.0%} of the token slots in held blocks "
                     "hold KV. Static batching reserves prompt + max_tokens up front; a smaller block_size or "
                     "continuous batching fills them",
    "max_num_seqs": "every batch slot was taken while requests waited: max_num_seqs ({max_num_seqs}) is too small "
                    "for this KV cache; raise it",
    "token_budget": "steps used the whole token budget while requests waited: max_num_batched_tokens "
                    "({max_num_batched_tokens}) is too small; raise it",
    "static_batch": "requests waited for the running batch to end with slots, budget and blocks to spare: "
                    "static batching admits nobody into a running batch; continuous batching would",
    "other": "no single limit was hit (slots, token budget and blocks all had room): requests arrived faster "
             "than steps admit them, or the runs are too short to fill the cache",
}


@dataclass(frozen=True)
class KVDiagnosis:
    """Why token-level KV utilisation stayed low while requests waited, with the share of waiting steps each
    cause explains (the most frequent one is ``cause``)."""

    token_utilisation: float  # mean over the steps with requests waiting
    block_utilisation: float
    waiting_steps: int
    cause: str
    cause_shares: dict[str, float] = field(default_factory=dict)
    message: str = ""


def diagnose_kv(steps: Sequence[StepSample], limits: EngineLimits, threshold: float = KV_UTILISATION_THRESHOLD,
                blocks_full_at: float = 0.9, min_waiting_share: float = MIN_WAITING_SHARE) -> KVDiagnosis | None:
    """None when requests waited in fewer than ``min_waiting_share`` of the steps, or token-level utilisation
    stayed at or above ``threshold`` while they did.

    Each waiting step is put down to the first limit it hit: the blocks (>= ``blocks_full_at`` of them held,
    so low token utilisation means held blocks are not filled: fragmentation), the slots (``max_num_seqs``
    running), the token budget (the step used all of it); else, in static mode with a batch running, static
    batching itself (nobody joins a running batch); else none of them ("other").
    """
    waiting = [s for s in steps if s.num_waiting > 0]
    if not waiting or len(waiting) < min_waiting_share * len(steps):
        return None
    token_util = float(np.mean([s.kv_tokens_used / limits.kv_tokens_total for s in waiting]))
    if token_util >= threshold:
        return None
    block_util = float(np.mean([s.kv_blocks_used / limits.kv_blocks_total for s in waiting]))
    counts = dict.fromkeys(CAUSES, 0)
    for s in waiting:
        if s.kv_blocks_used >= blocks_full_at * limits.kv_blocks_total:
            counts["fragmentation"] += 1
        elif s.num_running >= limits.max_num_seqs:
            counts["max_num_seqs"] += 1
        elif s.num_tokens >= limits.max_num_batched_tokens:
            counts["token_budget"] += 1
        elif limits.batching == "static" and s.num_running > 0:
            counts["static_batch"] += 1
        else:
            counts["other"] += 1
    cause = max(counts, key=lambda c: counts[c])  # ties: the first in CAUSES order
    held = sum(s.kv_blocks_used for s in waiting) * limits.block_size
    fill = sum(s.kv_tokens_used for s in waiting) / held if held else float("nan")
    message = (f"token-level KV utilisation {token_util:.0%} (< {threshold:.0%}) while requests waited in "
               f"{len(waiting)} of {len(steps)} steps; likely cause: "
               + CAUSES[cause].format(fill=fill, max_num_seqs=limits.max_num_seqs,
                                      max_num_batched_tokens=limits.max_num_batched_tokens))
    if limits.batching == "static" and cause not in ("other", "static_batch"):
        message += " (or use continuous batching: a static batch keeps its finished members' slots until it ends)"
    return KVDiagnosis(token_util, block_util, len(waiting), cause,
                       {c: n / len(waiting) for c, n in counts.items()}, message)


# The engine's watch looks at every SAMPLE_EVERY-th step, over the last DIAGNOSIS_WINDOW samples, and diagnoses
# again every DIAGNOSE_EVERY steps: cheap enough for every engine, slow enough to see states, not bursts.
SAMPLE_EVERY, DIAGNOSIS_WINDOW, DIAGNOSE_EVERY = 10, 100, 200


class KVWatch:
    """The engine's own recent steps, sampled, and the latest diagnosis of them (logged when its cause changes)."""

    def __init__(self, limits: EngineLimits) -> None:
        self.limits = limits
        self._samples: deque[StepSample] = deque(maxlen=DIAGNOSIS_WINDOW)
        self.diagnosis: KVDiagnosis | None = None

    def observe(self, step_index: int, sample: Callable[[], StepSample]) -> None:
        """Step ``step_index`` ran; ``sample()`` describes it (made only for the steps sampled)."""
        if step_index % SAMPLE_EVERY:
            return
        self._samples.append(sample())
        if step_index % DIAGNOSE_EVERY:
            return
        diagnosis = diagnose_kv(list(self._samples), self.limits)
        if diagnosis is not None and (self.diagnosis is None or self.diagnosis.cause != diagnosis.cause):
            logger.warning("KV cache under-used: %s", diagnosis.message)
        self.diagnosis = diagnosis
