"""Logit adjustments before sampling: logit_bias, repetition, presence and frequency penalties.

Each request that asks for any keeps its own state here, beside the sampler (so the runner, which may run a
step ahead of the host with async scheduling, updates it with each token it samples, before the host sees
that token): a count of every vocabulary entry it has generated and a mask of its prompt's tokens, both
dense [vocab] tensors on the logits' device, updated in place one token at a time (nothing is rebuilt from
the whole output). A step stacks the rows that need them and adjusts those rows in one vectorised pass;
rows without adjustments are not touched. State goes when the scheduler reports the request finished.

Order (vLLM's): the logit bias, then the repetition penalty (transformers' ``RepetitionPenaltyLogitsProcessor``:
a seen token's positive logit divided by the penalty, a negative one multiplied), then OpenAI's frequency and
presence penalties (``logit -= frequency * count + presence * (count > 0)``, over generated tokens only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inflight.engine.request_state import PerRequestState


@dataclass
class PenaltyState:
    counts: torch.Tensor  # [vocab] float32: how many times each token was generated
    prompt_mask: torch.Tensor | None  # [vocab] bool: tokens of the prompt (only with a repetition penalty)
    bias: torch.Tensor | None  # [vocab] float32: the logit bias (None without one)


class Penalties(PerRequestState[PenaltyState]):
    def apply(self, logits: torch.Tensor, rows: list[int], requests: list) -> torch.Tensor:
        """``logits`` [num_rows, vocab] with the adjustments of ``rows`` (which ask for some) applied; the others
        as they are. ``requests``: the engine ``Request`` of each row of ``logits``."""
        vocab = logits.shape[1]
        params = [r.params for r in requests]
        states = [self._state(requests[i], vocab, logits.device) for i in rows]
        index = torch.tensor(rows, device=logits.device)
        x = logits.index_select(0, index)
        if any(s.bias is not None for s in states):
            x = x + torch.stack([s.bias if s.bias is not None else torch.zeros_like(s.counts) for s in states])
        counts = torch.stack([s.counts for s in states])  # [rows, vocab]
        repetition = [params[i].repetition_penalty for i in rows]
        if any(rp != 1.0 for rp in repetition):
            seen = counts > 0
            masks = [s.prompt_mask for s in states]
            seen |= torch.stack([m if m is not None else torch.zeros_like(seen[0]) for m in masks])
            rp = torch.tensor(repetition, device=x.device, dtype=x.dtype)[:, None]
            x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
        frequency = torch.tensor([params[i].frequency_penalty for i in rows], device=x.device, dtype=x.dtype)
        presence = torch.tensor([params[i].presence_penalty for i in rows], device=x.device, dtype=x.dtype)
        if bool(frequency.any()) or bool(presence.any()):
            x = x - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(x.dtype)
        out = logits.clone()
        out[index] = x
        return out

    def record(self, rows: list[int], requests: list, token_ids: list[int]) -> None:
        """The tokens just sampled for ``rows``: counted for the next step."""
        for i in rows:
            state = self._states.get(requests[i].request_id)
            if state is not None:
                state.counts[token_ids[i]] += 1

    def _state(self, request, vocab: int, device: torch.device) -> PenaltyState:
        request_id, params = request.request_id, request.params
        state = self._states.get(request_id)
        if state is None:
            mask = None
            if params.repetition_penalty != 1.0:
                mask = torch.zeros(vocab, dtype=torch.bool, device=device)
                mask[torch.tensor(request.prompt_token_ids, device=device)] = True
            bias = None
            if params.logit_bias:
                bias = torch.zeros(vocab, device=device)
                ids, values = zip(*params.logit_bias)
                bias[torch.tensor(ids, device=device)] = torch.tensor(values, dtype=bias.dtype, device=device)
            # A continued sequence (engine.request.Continuation) arrives with output: counted from the start. Read
            # on the device thread while the host may append to that list (async scheduling): safe only because
            # state is built at a request's first sampled row, when no token of it is in flight, and dropped only
            # once it has ended. Dropping it for a live request (on preemption, say) would rebuild it here while
            # the previous step's token is still being appended, and miss that token.
            counts = torch.bincount(torch.tensor(request.output_token_ids, dtype=torch.long),
                                    minlength=vocab).to(device=device, dtype=torch.float32)
            state = self._states[request_id] = PenaltyState(counts, mask, bias)
        return state
