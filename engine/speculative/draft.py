"""The ``draft`` proposer: a smaller checkpoint with the target's vocabulary guesses greedily, k tokens ahead.

It runs in the engine's process on the engine's device, through a ``ModelRunner`` of its own (its model, its paged
KV cache, its attention backend) and a block table per request (``KVCacheManager``, no prefix caching). Each step,
for the rows that propose:

1. catch-up: the tokens the draft has not seen (a new request's whole prompt, or the tokens the last step
   emitted) go in as one chunk per row; the logits at the row's last token give the first guess;
2. k - 1 decode rounds feed each guess back for the next one.

The draft's KV then holds the request's real tokens up to its last one; what it wrote for its own guesses is
past that point and simply written over next time (``computed`` stays at the real length). When the draft's pool
is out of blocks a row proposes nothing that step (and gives back the draft's blocks for it: they are recomputed
when it proposes again), so the draft never preempts the target's work.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from inflight.engine.block_pool import KVCacheManager
from inflight.engine.models.source import read_model_source
from inflight.engine.sampler import SamplingBatch
from inflight.engine.sampling_params import SamplingParams
from inflight.engine.scheduler_output import SchedulerOutput
from inflight.engine.speculative.proposers import Proposer

if TYPE_CHECKING:
    from inflight.engine.config import EngineConfig
    from inflight.engine.request import Request

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


class DraftProposer(Proposer):
    def __init__(self, draft_model: str, engine_config: "EngineConfig", max_model_len: int, vocab_size: int,
                 num_kv_blocks: int) -> None:
        from inflight.engine.model_runner import ModelRunner  # the runner imports the sampler, which imports this package

        source = read_model_source(draft_model)
        if source.config.vocab_size != vocab_size:
            raise ValueError(f"speculative_config.draft_model: its vocabulary ({source.config.vocab_size} tokens) "
                             f"is not the target's ({vocab_size}); a draft must share the target's tokenizer")
        config = dataclasses.replace(engine_config, model=draft_model, num_kv_blocks=num_kv_blocks,
                                     kv_cache_memory_bytes=None, swap_space_bytes=0, enforce_eager=True,
                                     speculative_config=None, preemption_mode="recompute",
                                     tensor_parallel_size=1)  # (small: on rank 0 whole)
        self.runner = ModelRunner(config, source, max_model_len, window_kv=False)
        self.kv = KVCacheManager(self.runner.num_kv_blocks, self.runner.block_size)
        self.computed: dict[str, int] = {}  # request id -> tokens whose KV the draft holds

    def forget(self, request_id: str) -> None:
        self.kv.free(request_id)
        self.computed.pop(request_id, None)

    def propose_batch(self, requests: list["Request"], ks: list[int]) -> list[list[int]]:
        proposals: list[list[int]] = [[] for _ in requests]
        rows = []
        for i, (request, k) in enumerate(zip(requests, ks)):
            if k <= 0:
                continue
            if not self.kv.allocate(request.request_id, len(request.all_token_ids) + k - 1):
                self.forget(request.request_id)  # no room this step: start over when there is
                continue
            rows.append(i)
        if not rows:
            return proposals
        # Round 0: what the draft has not seen, up to the request's last token; it guesses the next one.
        batch = SchedulerOutput()
        for i in rows:
            request = requests[i]
            start = self.computed.get(request.request_id, 0)
            tokens = request.all_token_ids
            batch.request_ids.append(request.request_id)
            batch.input_token_ids.extend(tokens[start:])
            batch.query_lens.append(len(tokens) - start)
            batch.start_positions.append(start)
            self.computed[request.request_id] = len(tokens)
        guesses = self._run(batch, requests, rows)
        for i, token_id in zip(rows, guesses):
            proposals[i].append(token_id)
        # Rounds 1..k-1: each guess goes back in at the next position.
        for round_ in range(1, max(ks[i] for i in rows)):
            rows = [i for i in rows if ks[i] > round_]
            batch = SchedulerOutput()
            for i in rows:
                request = requests[i]
                batch.request_ids.append(request.request_id)
                batch.input_token_ids.append(proposals[i][-1])
                batch.query_lens.append(1)
                batch.start_positions.append(len(request.all_token_ids) + round_ - 1)
            for i, token_id in zip(rows, self._run(batch, requests, rows)):
                proposals[i].append(token_id)
        return proposals

    def _run(self, batch: SchedulerOutput, requests: list["Request"], rows: list[int]) -> list[int]:
        tables = self.kv.block_tables
        batch.block_tables = [tables[requests[i].request_id].copy() for i in rows]
        batch.sample = [True] * len(rows)
        batch.padding = [False] * len(rows)
        sampling = SamplingBatch([_GREEDY] * len(rows), [0] * len(rows), frozenset())
        return self.runner.execute(batch, sampling).sampled_token_ids
