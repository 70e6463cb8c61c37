"""The scheduler's choice (requests and how many tokens each computes) as the runner's ``SchedulerOutput``.

It runs for every row of every general step, so it binds appends and locals instead of looking attributes up.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from inflight.engine.scheduler_output import PLACEHOLDER_TOKEN_ID, PromptRow, SchedulerOutput

if TYPE_CHECKING:
    from inflight.engine.block_pool import KVCacheManager
    from inflight.engine.request import Request


def build_batch(requests: list[Request], counts: list[int], kv: KVCacheManager, with_prompt_work: bool,
                long_rope: bool = False, clock: Callable[[], float] = time.time) -> SchedulerOutput:
    """Row i computes ``counts[i]`` tokens of ``requests[i]`` from its ``num_computed_tokens`` on: a prompt chunk,
    a decode (its input the token an in-flight step samples, when it has not landed: a placeholder), or a decode
    and its proposed tokens to verify (``spec_token_ids``). ``with_prompt_work``: some request may owe prompt
    outputs or generate nothing (``PromptRow``s; cheaper to skip when none does). ``long_rope``: a LongRoPE model,
    whose rows say whether their prompts rotate long. ``clock``: the scheduler's (a request's first scheduled time)."""
    out = SchedulerOutput()
    add_id, add_input, extend_input = out.request_ids.append, out.input_token_ids.append, out.input_token_ids.extend
    add_query_len, add_start, add_sample = out.query_lens.append, out.start_positions.append, out.sample.append
    add_padding = out.padding.append
    now = None
    for request, num_new in zip(requests, counts):
        start = request.num_computed_tokens
        add_id(request.request_id)
        token_ids = request.all_token_ids
        if num_new == 1:
            if start < len(token_ids):
                add_input(token_ids[start])
            else:  # the token an in-flight step samples: the runner puts it in
                out.placeholder_rows.append(len(out.request_ids) - 1)
                add_input(PLACEHOLDER_TOKEN_ID)
        elif start + num_new > len(token_ids):  # a decode row and its proposed tokens, to verify
            proposed = list(request.spec_token_ids[:start + num_new - len(token_ids)])
            extend_input(token_ids[start:])
            extend_input(proposed)
            out.spec_token_ids[len(out.request_ids) - 1] = proposed
        else:
            extend_input(token_ids[start:start + num_new])
        add_query_len(num_new)
        add_start(start)
        add_sample(start + num_new >= len(token_ids) + request.num_pending_tokens)
        add_padding(False)
        metrics = request.metrics
        if metrics.first_scheduled_time is None:
            now = now or clock()
            metrics.first_scheduled_time = now
    # copies (C loops, every row): the KV manager grows its lists for the next step while the runner reads these
    out.block_tables = list(map(list.copy, map(kv.block_tables.__getitem__, out.request_ids)))
    if kv.window is not None:
        out.window_tables = list(map(list.copy, map(kv.window_tables.__getitem__, out.request_ids)))
    if long_rope:
        out.long_rope = [request.long_rope for request in requests]
    if with_prompt_work:
        _add_prompt_rows(out, requests)
    return out


def _add_prompt_rows(out: SchedulerOutput, requests: list[Request]) -> None:
    """Prefill-only rows sample nothing; rows that owe prompt logprobs or pooled states say so."""
    for row, request in enumerate(requests):
        if not request.has_prompt_work:
            continue
        end = out.start_positions[row] + out.query_lens[row]
        if request.prefill_only:
            out.sample[row] = False
        if request.needs_prompt_outputs():
            prompt = request.prompt_token_ids
            num_top = request.params.prompt_logprobs if request.prompt_logprobs is not None else None
            out.prompt_rows[row] = PromptRow(num_top, request.pool, prompt[end] if end < len(prompt) else None)
