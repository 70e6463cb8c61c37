"""Our engine on a workload: requests arrive on a step clock, and every step is recorded.

The step clock is the sum of the engine's step times. When the engine is idle it jumps to the next
arrival instead of sleeping, so a sparse trace costs only the time its steps take, and latencies are what
they would be in real time (queueing included) minus the replay loop's own overhead. With every request
at t=0 this is plain offline throughput.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from tqdm import tqdm

from benchmarks.common.metrics import (
    EngineLimits, KVDiagnosis, StepSample, TokenWaste, diagnose_kv, summarize, summarize_steps,
    useful_computed_tokens,
)
from benchmarks.common.workloads import BenchRequest, request_params


@dataclass
class EngineRun:
    """One workload through one engine. Times are seconds on the step clock, the first arrival at 0."""

    limits: EngineLimits
    requests: Sequence[BenchRequest]
    arrivals_s: list[float]
    first_token_s: list[float]
    finished_s: list[float]
    steps: list[StepSample]
    records: list[Any] = field(default_factory=list)  # the engine's StepRecords, when asked for
    num_preemptions: int = 0
    # tokens each request got (None: exactly its max_tokens); fewer where a request stopped at end of sequence
    output_tokens: list[int] | None = None

    @property
    def span_s(self) -> float:
        return max(self.finished_s) - min(self.arrivals_s)

    @property
    def latencies_s(self) -> list[float]:
        return [f - a for f, a in zip(self.finished_s, self.arrivals_s)]

    @property
    def ttfts_s(self) -> list[float]:
        return [t - a for t, a in zip(self.first_token_s, self.arrivals_s)]

    @property
    def output_lens(self) -> list[int]:
        return list(self.output_tokens) if self.output_tokens is not None else [r.max_tokens for r in self.requests]

    @property
    def useful_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.span_s

    def waste(self) -> TokenWaste:
        step_summary = summarize_steps(self.steps, self.limits)
        useful = useful_computed_tokens([r.prompt_len for r in self.requests], self.output_lens)
        return TokenWaste(step_summary["computed_tokens"], useful, step_summary["padding_tokens"])

    def diagnosis(self) -> KVDiagnosis | None:
        return diagnose_kv(self.steps, self.limits)

    def summary(self) -> dict[str, Any]:
        waste = self.waste()
        diagnosis = self.diagnosis()
        return {
            "batching": self.limits.batching, "max_num_seqs": self.limits.max_num_seqs,
            "tokens_per_s": self.tokens_per_s, "span_s": self.span_s, "useful_tokens": self.useful_tokens,
            "latency_s": summarize(self.latencies_s), "ttft_s": summarize(self.ttfts_s),
            "steps": summarize_steps(self.steps, self.limits),
            "computed_tokens": waste.computed, "padding_tokens": waste.padding, "wasted_tokens": waste.wasted,
            "num_preemptions": self.num_preemptions,
            "kv_diagnosis": diagnosis.message if diagnosis else None,
        }


def step_sample(record) -> StepSample:
    """The numbers of one engine ``StepRecord``. A row that verifies proposed tokens decodes."""
    batch = record.batch
    prefill = decode = padding = 0
    verifying = batch.spec_token_ids
    for row, (num_tokens, is_padding) in enumerate(zip(batch.query_lens, batch.padding)):
        if is_padding:
            padding += 1
        elif num_tokens == 1 or row in verifying:
            decode += 1
        else:
            prefill += num_tokens
    return StepSample(record.duration_s, prefill, decode, padding, len(record.running_ids), record.num_waiting,
                      record.kv_blocks_used, record.kv_tokens_used, batch.num_spec_tokens)


def engine_limits(engine) -> EngineLimits:
    config = engine.config
    return EngineLimits(config.batching, config.max_num_seqs, config.max_num_batched_tokens,
                        engine.scheduler.kv.pool.num_blocks, config.block_size)


def run_engine(engine, requests: Sequence[BenchRequest], arrivals_s: Sequence[float] | None = None,
               desc: str = "", keep_records: bool = False, wall_clock: bool = False) -> EngineRun:
    """Feed ``requests`` to ``engine`` at ``arrivals_s`` (default: all at 0, which must be sorted) on the
    step clock (``wall_clock``: on the wall clock, sleeping while idle, every step's whole time counted: front
    end and the loop's own work too); step until every request is done. Each must get exactly its ``max_tokens``
    (at most, if it stops at end of sequence: ``ignore_eos`` False)."""
    arrivals = list(arrivals_s) if arrivals_s is not None else [0.0] * len(requests)
    if any(b < a for a, b in zip(arrivals, arrivals[1:])):
        raise ValueError("arrivals_s must be sorted")
    records = []
    engine.step_listener = records.append
    preemptions_before = engine.scheduler.preemption.num_preemptions
    first_token: list[float | None] = [None] * len(requests)
    finished: list[float | None] = [None] * len(requests)
    tokens: list[int] = [0] * len(requests)
    clock, next_up = arrivals[0] if arrivals else 0.0, 0
    wall_start = time.perf_counter() - clock
    try:
        with tqdm(total=len(requests), desc=desc or engine.config.batching, unit="req", file=sys.stderr,
                  leave=False) as bar:
            while next_up < len(requests) or engine.has_unfinished_requests():
                while next_up < len(requests) and arrivals[next_up] <= clock:
                    request = requests[next_up]
                    engine.add_request(str(next_up), request.prompt_token_ids, request_params(request))
                    next_up += 1
                if not engine.has_unfinished_requests():
                    if wall_clock:
                        time.sleep(max(0.0, arrivals[next_up] - (time.perf_counter() - wall_start)))
                        clock = time.perf_counter() - wall_start
                    else:
                        clock = arrivals[next_up]  # idle: jump to the next arrival
                    continue
                outputs = engine.step()
                clock = time.perf_counter() - wall_start if wall_clock else clock + records[-1].duration_s
                for output in outputs:
                    i = int(output.request_id)
                    # (a request that generates nothing has its "first token" when it is done)
                    if first_token[i] is None and (output.outputs[0].token_ids or output.finished):
                        first_token[i] = clock
                    if output.finished:
                        finished[i] = clock
                        tokens[i] = len(output.outputs[0].token_ids)
                        bar.update(1)
    finally:
        engine.step_listener = None
    check_output_lens(tokens, requests)
    return EngineRun(engine_limits(engine), requests, arrivals, first_token, finished,  # type: ignore[arg-type]
                     [step_sample(r) for r in records], records if keep_records else [],
                     engine.scheduler.preemption.num_preemptions - preemptions_before, tokens)


def check_output_lens(tokens: Sequence[int], requests: Sequence[BenchRequest], system: str = "") -> None:
    """``RuntimeError`` unless each request got its ``max_tokens``, or, stopping at end of sequence, 1 to that many
    (a request that generates nothing, 0)."""
    def right(n: int, r: BenchRequest) -> bool:
        if r.ignore_eos or r.max_tokens == 0:
            return n == r.max_tokens
        return 1 <= n <= r.max_tokens

    wrong = [(i, n, r.max_tokens) for i, (n, r) in enumerate(zip(tokens, requests)) if not right(n, r)]
    if wrong:
        i, got, wanted = wrong[0]
        raise RuntimeError(f"{system + ': ' if system else ''}{len(wrong)} request(s) got the wrong number of tokens "
                           f"(request {i}: {got}, asked for {wanted})")
