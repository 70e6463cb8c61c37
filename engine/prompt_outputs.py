"""What a prompt chunk hands back besides a sampled token: the logprob of each prompt token it predicts (prompt
logprobs, scoring) and the sum of its final-norm hidden states (an embedding, pooled over the chunks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from inflight.engine.scheduler_output import PromptRow

if TYPE_CHECKING:
    from inflight.engine.models.llama import CausalLM
    from inflight.engine.sampler import TokenLogprobs

# Prompt logprobs need logits for every prompt position: they are computed this many bytes of [rows, vocab]
# float32 at a time, so a long prompt never holds tokens x vocab logits at once.
PROMPT_LOGITS_CHUNK_BYTES = 1 << 26


@dataclass
class PromptOutput:
    """What one prompt chunk handed back (``PromptRow``): the logprob of each prompt token it predicts, in
    order, and the sum over its positions of the final-norm hidden state."""

    logprobs: list[TokenLogprobs] | None
    pooled_sum: torch.Tensor | None  # [hidden] float32 on the host


def prompt_outputs(model: CausalLM, hidden: torch.Tensor, input_token_ids: list[int], query_lens: list[int],
                   rows: dict[int, PromptRow]) -> dict[int, PromptOutput]:
    """Prompt logprobs and pooled hidden states of the rows asking for them; ``hidden`` [num_tokens, hidden]."""
    starts = np.cumsum([0, *query_lens[:-1]]).tolist()
    pooled: dict[int, torch.Tensor] = {}
    positions: list[int] = []  # flat token index of each position that predicts a prompt token
    targets: list[int] = []  # the token it predicts
    counts: dict[int, int] = {}
    for row, work in rows.items():
        start, end = starts[row], starts[row] + query_lens[row]
        if work.pool:
            pooled[row] = model.final_hidden(hidden[start:end]).float().sum(dim=0).cpu()
        if work.num_top_logprobs is not None:
            row_targets = input_token_ids[start + 1:end]
            if work.next_token_id is not None:
                row_targets = [*row_targets, work.next_token_id]
            positions.extend(range(start, start + len(row_targets)))
            targets.extend(row_targets)
            counts[row] = len(row_targets)
    logprobs = token_logprobs(model, hidden, positions, targets,
                              max((w.num_top_logprobs or 0 for w in rows.values()), default=0))
    out, taken = {}, 0
    for row, work in rows.items():
        row_logprobs = None
        if row in counts:
            row_logprobs = [(chosen, top[:work.num_top_logprobs])
                            for chosen, top in logprobs[taken:taken + counts[row]]]
            taken += counts[row]
        out[row] = PromptOutput(row_logprobs, pooled.get(row))
    return out


def token_logprobs(model: CausalLM, hidden: torch.Tensor, positions: list[int], targets: list[int],
                   num_top: int) -> list[TokenLogprobs]:
    """For each position: (target, its logprob, its rank) and the ``num_top`` best (token, logprob), computed
    in chunks of rows so that [rows, vocab] logits stay within ``PROMPT_LOGITS_CHUNK_BYTES``."""
    chunk = max(1, PROMPT_LOGITS_CHUNK_BYTES // (4 * model.config.vocab_size))
    result: list[TokenLogprobs] = []
    for first in range(0, len(positions), chunk):
        index = torch.tensor(positions[first:first + chunk], device=hidden.device)
        wanted = torch.tensor(targets[first:first + chunk], device=hidden.device)
        logits = model.compute_logits(hidden[index])
        if logits is None:  # a tensor-parallel rank other than 0: it only takes part in computing them
            continue
        logprobs = torch.log_softmax(logits, dim=-1)  # [rows, vocab]
        chosen = logprobs.gather(1, wanted[:, None])  # [rows, 1]
        ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
        if num_top:
            top_values, top_ids = logprobs.topk(num_top, dim=-1)
            tops = [list(zip(ids, values)) for ids, values in zip(top_ids.tolist(), top_values.tolist())]
        else:
            tops = [[] for _ in ranks]
        for token_id, value, rank, top in zip(wanted.tolist(), chosen[:, 0].tolist(), ranks, tops):
            result.append(((token_id, value, rank), top))
    return result
