"""Predict a request's time to first token from the work queued ahead of it and measured step costs.

Step time is modelled as (a decode step) + (time per prefill token) x (prefill tokens), both measured
from the engine's own recent steps (so they follow the machine, the model and the load without
configuration). A new request's first token needs:

1. a batch slot: if the slots are full once the requests ranked ahead of it are counted, it waits
   for that many running requests to end, estimated from their remaining output lengths (the
   engine caps open-ended ones at twice the typical output seen) at the current decode step time;
2. the prompts ahead of it pushed through the token budget left over by the decodes, chunk by chunk
   (this happens in the same steps as 1, so the longer of the two counts), then its own prompt.

The engine uses it at admission: a request whose deadline is sooner than the prediction is refused
at once (HTTP 429 with a ``Retry-After``) instead of timing out after occupying the queue.
"""

from __future__ import annotations

MIN_OBSERVATIONS = 8  # steps seen before predictions are trusted


class TTFTPredictor:
    """Two measured rates, each an exponential moving average over the engine's own steps: the time of a
    step with no prefill tokens (decodes only), and the extra time per prefill token in the other steps.

    (A least-squares fit of base + per token + per row was tried first: with mixed steps dominating under
    load its terms traded off against each other and predictions drifted by 20x.)"""

    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int, decay: float = 0.95) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.decay = decay
        self.decode_step_s: float | None = None
        self.per_prefill_token_s: float | None = None
        self.num_observations = 0

    @property
    def ready(self) -> bool:
        return self.num_observations >= MIN_OBSERVATIONS and self.per_prefill_token_s is not None

    def observe(self, seconds: float, num_prefill_tokens: int, num_decode_rows: int) -> None:
        self.num_observations += 1
        if num_prefill_tokens == 0:
            self.decode_step_s = self._average(self.decode_step_s, seconds)
            return
        base = self.decode_step_s if self.decode_step_s is not None else 0.0
        self.per_prefill_token_s = self._average(self.per_prefill_token_s,
                                                 max(0.0, seconds - base) / num_prefill_tokens)

    def _average(self, current: float | None, value: float) -> float:
        return value if current is None else self.decay * current + (1 - self.decay) * value

    def step_seconds(self, num_prefill_tokens: float, num_decode_rows: float = 0) -> float:
        """A step's predicted time; decode rows are part of the measured decode step (their count moves
        slowly compared with the average)."""
        return (self.decode_step_s or 0.0) + (self.per_prefill_token_s or 0.0) * num_prefill_tokens

    def predict(self, own_prompt_tokens: int, tokens_ahead: int, num_ahead: int,
                running_remaining: list[int], typical_output: int | None = None) -> float:
        """Seconds until the first token of a request with ``own_prompt_tokens`` left to compute, behind
        ``num_ahead`` waiting requests holding ``tokens_ahead`` uncomputed tokens, while requests with
        ``running_remaining`` output tokens left hold slots. ``typical_output``: how long a request that
        has just been admitted keeps its slot (default: the longest running remainder).

        The wait for a slot and the prefill of the prompts ahead happen in the same steps (chunks of
        their prefill ride with the decodes), so the longer of the two counts, then the request's own
        prefill."""
        num_rows = min(len(running_remaining), self.max_num_seqs)
        per_step = max(1, self.max_num_batched_tokens - num_rows)  # prefill tokens a step can take next to decodes
        slot_wait = 0.0
        must_end = num_ahead + 1 - (self.max_num_seqs - len(running_remaining))  # running requests that must end first
        if must_end > 0 and running_remaining:
            ordered = sorted(running_remaining)
            rounds, index = divmod(must_end - 1, len(ordered))  # each round frees every slot once more
            per_round = typical_output if typical_output is not None else ordered[-1]
            slot_wait = (ordered[index] + rounds * per_round) * self.step_seconds(0)
        ahead = self._prefill_seconds(tokens_ahead, per_step, num_rows)
        return max(slot_wait, ahead) + self._prefill_seconds(own_prompt_tokens, per_step, num_rows)

    def _prefill_seconds(self, tokens: int, per_step: int, num_rows: int) -> float:
        """``tokens`` of prompt pushed through steps of ``per_step`` prefill tokens next to ``num_rows`` decodes."""
        if tokens <= 0:
            return 0.0
        steps = -(-tokens // per_step)
        return steps * self.step_seconds(0) + tokens * (self.per_prefill_token_s or 0.0)
