"""The synchronous engine: schedule, run, process outputs — one step at a time."""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from itertools import compress, repeat
from operator import attrgetter, sub
from typing import Any, Callable, Iterable

from inflight.engine.config import EngineConfig
from inflight.engine.kv_diagnosis import EngineLimits, KVDiagnosis, StepSample, diagnose_kv
from inflight.engine.models.packaged import DEFAULT_MODEL
from inflight.engine.models.source import read_model_source
from inflight.engine.model_runner import (LaunchedStep, ModelRunner, PromptOutput, RunnerOutput, SharedBudget, resolve_device,
                                 resolve_dtype)
from inflight.engine.core_messages import CoreMetrics, PlainStep, Record, SequenceUpdate
from inflight.engine.output_processor import OutputProcessor
from inflight.engine.outputs import RequestOutput
from inflight.engine.persistent_batch import consume
from inflight.engine.prefill_lane import PrefillLane
from inflight.engine.request import Continuation, Request, RequestStatus
from inflight.engine.sampler import SamplingBatch
from inflight.engine.sampling_params import PoolingParams, SamplingParams
from inflight.engine.scheduler import make_scheduler
from inflight.engine.scheduler_output import SchedulerOutput, StepRecord
from inflight.engine.speculative import Speculator
from inflight.engine.speculative.draft import DraftProposer
from inflight.engine.request_maker import PromptInput, RequestMaker
from inflight.engine.ttft_predictor import QueueView, Rank, TTFTPredictor, check_deadline, predicts_for

logger = logging.getLogger(__name__)

# The KV diagnosis looks at every SAMPLE_EVERY-th step, over the last DIAGNOSIS_WINDOW samples, and is
# re-run every DIAGNOSE_EVERY steps: cheap enough for every engine, slow enough to see states, not bursts.
SAMPLE_EVERY, DIAGNOSIS_WINDOW, DIAGNOSE_EVERY = 10, 100, 200
_PARENT_ID, _PARAMS = attrgetter("parent_id"), attrgetter("params")
_OUTPUT, _SENT_LEN, _SENT_FIRST = attrgetter("output_token_ids"), attrgetter("sent_token_len"), attrgetter("sent_first_output")
_LOGPROBS, _REPORTS_AT_END = attrgetter("logprobs"), attrgetter("reports_at_end")


@dataclass
class _Launched:
    """A scheduled step being computed: its batch, its rows' requests, and its (result, seconds) once known:
    ``outcome`` when it was computed at once, ``future`` when it runs on the device thread (which sets it when it
    collects the step: ``LLMEngine._launch_on_device``)."""

    batch: SchedulerOutput
    rows: list[Request]
    future: Future | None
    outcome: tuple[RunnerOutput, float] | None = None


class LLMEngine:
    """Continuous (or static) batching over a paged KV cache.

    ``step()`` is the whole loop: the scheduler picks this step's batch, the runner computes it
    and samples, and the requests that got a token (or ended) come back as ``RequestOutput``s.
    A request that finishes, is aborted or times out gives its slot and blocks back in that step.
    """

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **engine_args)
        source = read_model_source(model)
        self.model_config = source.config
        self.tokenizer = source.tokenizer
        self.eos_token_ids = source.eos_token_ids
        self._max_model_len_note = ""
        self.max_model_len = self._resolve_max_model_len(source.config)
        self.runner = ModelRunner(self.config, source, self.max_model_len, self._draft_budget())
        self.config = self.runner.config  # the attention backend may have raised block_size
        self.max_model_len = self._fit_max_model_len_to_pool(self.runner.num_kv_blocks)
        self.scheduler = make_scheduler(self.config, self.runner.num_kv_blocks)
        self.request_maker = RequestMaker(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                                          self.max_model_len, self._max_model_len_note,
                                          self.runner.sampler.constraints)
        # Requests that generate nothing run here, apart from the scheduler and the KV cache (prefill_lane.py).
        self.lane = (PrefillLane(self.config.max_prefill_batch_tokens, self.config.max_prefill_batch_size)
                     if self.config.prefill_lane else None)
        self.output_processor = OutputProcessor(self.tokenizer)
        # Deadline-aware admission needs the continuous scheduler's step-by-step admission to predict.
        self.predictor = (TTFTPredictor(self.config.max_num_batched_tokens, self.config.max_num_seqs)
                          if self.config.batching == "continuous" else None)
        self._set_preemption_costs()
        self._sum_output_lengths = 0  # of finished requests, for the predictor's estimate of remaining work
        self._num_output_lengths = 0
        self._kv_samples: collections.deque[StepSample] = collections.deque(maxlen=DIAGNOSIS_WINDOW)
        self.kv_diagnosis: KVDiagnosis | None = None
        self._children: dict[str, list[Request]] = {}  # request id -> its n sequences
        self.num_steps = 0
        self._token_time = 0.0  # when the latest step's tokens arrived
        # the rows of the persistent batch last found to be a _plain_step, and their output lists
        self._plain_rows: list[Request] | None = None
        self._plain_outputs: list[list[int]] = []
        self.last_batch_size = 0  # rows computed by the latest step
        self.num_finished_requests = 0
        self.num_generated_tokens = 0
        # Called at the end of every step with what it did; off (None) unless a benchmark or tracer sets it.
        self.step_listener: Callable[[StepRecord], None] | None = None
        # Async scheduling: the thread that runs the forwards, in order, and the step it is computing.
        config = self.config
        use_async = (config.async_scheduling if config.async_scheduling is not None
                     else config.batching == "continuous" and self.runner.device.type == "cuda"
                     and config.speculative_config is None)
        self._device = ThreadPoolExecutor(1, thread_name_prefix="inflight-device") if use_async else None
        self._in_flight: _Launched | None = None
        # The device thread's own: the step it launched and has not collected yet, with the future it answers.
        self._uncollected: tuple[LaunchedStep, Future] | None = None
        self.speculator = self._make_speculator()
        self.scheduler.speculative = self.speculator is not None
        # Requests whose structured output compiles on a pool thread (the step loop does not wait for it), and
        # those aborted meanwhile.
        self._grammar_pool: ThreadPoolExecutor | None = None
        self._compiling: list[tuple[Future, list[Request]]] = []
        self._aborted_unqueued: list[list[Request]] = []

    def _draft_budget(self) -> SharedBudget | None:
        """A draft model's share of the KV budget (its weights, and KV for as many tokens as the target's)."""
        spec = self.config.speculative_config
        if spec is None or spec.method != "draft":
            return None
        draft = read_model_source(spec.draft_model).config
        itemsize = resolve_dtype(self.config.dtype, draft.torch_dtype, resolve_device(self.config.device)).itemsize
        return SharedBudget(draft.num_parameters * itemsize, draft.kv_bytes_per_token(itemsize))

    def _make_speculator(self) -> Speculator | None:
        spec = self.config.speculative_config
        if spec is None:
            return None
        draft = None
        if spec.method == "draft":  # its KV cache holds as many tokens as the target's
            draft = DraftProposer(spec.draft_model, self.config, self.max_model_len, self.model_config.vocab_size,
                                  self.runner.num_kv_blocks)
        return Speculator(spec, self.eos_token_ids, draft)

    def _set_preemption_costs(self) -> None:
        """Swap or recompute a victim: time to copy its blocks out and back at the measured host-copy rate,
        against time to recompute its tokens at the measured prefill cost per token."""
        runner, scheduler = self.runner, self.scheduler
        scheduler.set_swap_space(runner.num_swap_blocks)
        if runner.num_swap_blocks:
            scheduler.swap_seconds = lambda blocks: 2 * blocks * runner.kv_bytes_per_block / runner.swap_bytes_per_s

        def recompute_seconds(tokens: int) -> float:
            predictor = self.predictor
            if predictor is None or predictor.per_prefill_token_s is None:
                return tokens * 1e-4
            return tokens * predictor.per_prefill_token_s

        scheduler.recompute_seconds = recompute_seconds

    def _sample_kv(self, batch: SchedulerOutput, seconds: float) -> None:
        """Record this step for the KV diagnosis; every DIAGNOSE_EVERY steps, diagnose (the seed's advice:
        token-level KV use under 60% while requests wait means a limit other than memory is hit)."""
        scheduler = self.scheduler
        padding = sum(batch.padding)
        decode = batch.num_decode_rows - padding
        num_spec_tokens = batch.num_spec_tokens
        self._kv_samples.append(StepSample(
            seconds, batch.num_tokens - decode - padding - num_spec_tokens, decode, padding, len(scheduler.running),
            len(scheduler.waiting), scheduler.kv.pool.num_used, scheduler.kv_stats().num_tokens_used,
            num_spec_tokens))
        if self.num_steps % DIAGNOSE_EVERY:
            return
        config = self.config
        limits = EngineLimits(config.batching, config.max_num_seqs, config.max_num_batched_tokens,
                              scheduler.kv.pool.num_blocks, config.block_size)
        diagnosis = diagnose_kv(list(self._kv_samples), limits)
        if diagnosis is not None and (self.kv_diagnosis is None or self.kv_diagnosis.cause != diagnosis.cause):
            logger.warning("KV cache under-used: %s", diagnosis.message)
        self.kv_diagnosis = diagnosis

    def _resolve_max_model_len(self, cfg) -> int:
        limit = cfg.max_position_embeddings
        if cfg.sliding_window is not None:
            limit = min(limit, cfg.sliding_window)  # no sliding-window attention: stay inside the window
        wanted = self.config.max_model_len
        if wanted is None:
            return limit
        if wanted > limit:
            raise ValueError(f"max_model_len {wanted} exceeds the model's limit of {limit} positions")
        return wanted

    def _fit_max_model_len_to_pool(self, num_kv_blocks: int) -> int:
        """A request must be able to grow to max_model_len alone, or it could evict itself forever."""
        capacity = num_kv_blocks * self.config.block_size
        if self.max_model_len <= capacity:
            return self.max_model_len
        if self.config.max_model_len is not None:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the KV cache's capacity of {capacity} "
                             f"tokens ({num_kv_blocks} blocks of {self.config.block_size}); raise num_kv_blocks "
                             f"or lower max_model_len")
        self._max_model_len_note = (f" (capped by the KV cache: {num_kv_blocks} blocks of {self.config.block_size} "
                                    f"tokens; raise num_kv_blocks)")
        return capacity

    # -- requests ---------------------------------------------------------------------------------
    def make_requests(self, request_id: str, prompt: PromptInput,
                      params: SamplingParams | PoolingParams | None = None, priority: int = 0,
                      arrival_time: float | None = None,
                      continuations: dict[int, Continuation] | None = None) -> list[Request]:
        """Validate and tokenize without touching the queue (safe from any thread): see ``RequestMaker``."""
        return self.request_maker.make_requests(request_id, prompt, params, priority, arrival_time, continuations)

    def enqueue(self, requests: list[Request]) -> None:
        """Queue a request made by ``make_requests``; its outputs come from ``step``."""
        self.enqueue_core(requests)
        self.output_processor.add(requests)

    def enqueue_core(self, requests: list[Request]) -> None:
        """Queue a request in the core alone: a front end elsewhere (``AsyncLLMEngine``) makes its outputs from
        ``core_step``'s records. Raises ``ValueError`` or ``DeadlineUnmeetableError`` if it is refused."""
        parent = requests[0].parent_id
        if parent in self._children:
            raise ValueError(f"request_id {parent!r} is already in use")
        if predicts_for(self.config, requests[0]):
            predicted = self.check_deadline(requests, self.queue_view())
            for request in requests:
                request.metrics.predicted_ttft_s = predicted
        self._children[parent] = requests
        constraint = requests[0].params.structured_output
        if constraint is not None:  # compiled off the step loop; it joins the queue when its grammar is ready
            if self._grammar_pool is None:
                self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="inflight-grammar")
            self._compiling.append((self._grammar_pool.submit(self.runner.sampler.constraints.compile, constraint),
                                    requests))
            return
        self._queue(requests)

    def _queue(self, requests: list[Request]) -> None:
        queue = self.lane if self.lane is not None and requests[0].prefill_only else self.scheduler
        for request in requests:
            queue.add(request)

    def _take_compiled(self, touched: dict[str, None]) -> None:
        """Requests whose grammar has compiled join the queue; one whose grammar failed ends (aborted: the server
        checked it when the request was made, so this is a compile that failed only here)."""
        waiting = []
        for future, requests in self._compiling:
            if not future.done():
                waiting.append((future, requests))
            elif future.exception() is not None:
                logger.warning("structured output of request %s failed to compile: %s", requests[0].parent_id,
                               future.exception())
                self._end_unqueued(requests, touched)
            else:
                self._queue(requests)
        self._compiling = waiting
        for requests in self._aborted_unqueued:
            self._end_unqueued(requests, touched)
        self._aborted_unqueued = []
        if waiting and not self.scheduler.has_unfinished():  # nothing else to do: wait a little, not spin
            wait([f for f, _ in waiting], timeout=0.002, return_when=FIRST_COMPLETED)

    def _end_unqueued(self, requests: list[Request], touched: dict[str, None]) -> None:
        for request in requests:
            request.status, request.finish_reason = RequestStatus.FINISHED, "abort"
            request.metrics.finished_time = time.time()
        touched[requests[0].parent_id] = None

    def _expected_remaining(self, request: Request) -> int:
        """Output tokens a running request will still produce: its max_tokens bound, or, once requests have
        finished, no more than twice the mean output length seen (a request without max_tokens may run to
        max_model_len, but few do, and assuming it would refuse requests that would have made it)."""
        bound = request.max_total_tokens - request.num_tokens
        if self._num_output_lengths < 5:
            return bound
        typical = 2 * self._sum_output_lengths / self._num_output_lengths
        return max(1, min(bound, int(typical) - request.num_output_tokens))

    def queue_view(self) -> QueueView | None:
        """The queue as admission sees it (ttft_predictor.QueueView), or None while the predictor has too few
        steps to trust. Called from the step thread only: it reads the scheduler's queues."""
        predictor = self.predictor
        if predictor is None or not predictor.ready:
            return None
        scheduler, now = self.scheduler, time.time()
        running = scheduler.running
        remaining = [self._expected_remaining(r) for r in running]
        # How long a newly admitted request holds its slot: the mean output length of the finished requests and
        # the running ones (their expected length). Finished ones alone are a handful on a cold start: their mean
        # was 30% off and each round of slots in a deep queue repeated it (slot waits 1.4x too long).
        num_lengths = self._num_output_lengths + len(running)
        typical = ((self._sum_output_lengths + sum(remaining) + sum(len(r.output_token_ids) for r in running))
                   // num_lengths if num_lengths else None)
        # Prompt chunks still to come for running requests take the budget before any waiting request's.
        prefilling = sum(left for r in running if (left := len(r.all_token_ids) - r.num_computed_tokens) > 1)
        waiting = ((scheduler.rank(r, now), r.num_tokens - r.num_computed_tokens) for r in scheduler.waiting)
        return QueueView.take(predictor, now, waiting, prefilling, remaining, typical,
                              priority_policy=self.config.scheduling_policy == "priority")

    def check_deadline(self, requests: list[Request], view: QueueView | None, now: float | None = None,
                       also_ahead: Iterable[tuple[Rank, int]] = ()) -> float | None:
        """``ttft_predictor.check_deadline`` (a method, so that benchmarks can watch what it predicts)."""
        return check_deadline(requests, view, now, also_ahead)

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | PoolingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None,
                    continuations: dict[int, Continuation] | None = None) -> None:
        if request_id in self._children:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.enqueue(self.make_requests(request_id, prompt, params, priority, arrival_time, continuations))

    def abort_request(self, request_id: str) -> None:
        """End the request now: its blocks are free before the next step. Unknown ids are ignored."""
        compiling = [entry for entry in self._compiling if entry[1][0].parent_id == request_id]
        if compiling:  # not queued yet: it ends with the next step's outputs
            self._compiling.remove(compiling[0])
            self._aborted_unqueued.append(compiling[0][1])
            return
        for child in self._children.get(request_id, ()):
            if self.scheduler.abort(child.request_id) is None and self.lane is not None:
                self.lane.abort(child.request_id)

    # -- the loop -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step of the loop; returns the outputs of the requests that got a token or ended.

        Synchronously: schedule, compute, process. With async scheduling: schedule and launch this step, then
        process the previous step's results while this one computes; outputs lag the device by one step. The
        core's step (``core_step``) then its front end (``OutputProcessor``): text, stop strings, outputs."""
        outputs, stopped = self.output_processor.process(self.core_step())
        for request_id, stop in stopped:
            self.finish_stopped(request_id, stop)
        return outputs

    def core_step(self) -> list[Record]:
        """One step of the core: schedule, compute, apply the tokens (token-level stop rules), and report each
        sequence that got tokens or ended as a record (core_messages.py), for a front end to turn into
        text and outputs. A process that runs only the core (engine_core) sends these."""
        scheduler = self.scheduler
        listener = self.step_listener
        started = time.perf_counter()
        touched: dict[str, None] = {}
        if self._compiling or self._aborted_unqueued:  # before scheduling: a grammar ready now is admitted now
            self._take_compiled(touched)
        batch, launched = self._schedule_and_launch()
        record = self._record_step(batch) if listener is not None else None  # empty steps too: they take time
        touched.update(dict.fromkeys(r.parent_id for r in scheduler.drain_ended_without_token()))
        if self._device is None:
            done = launched
        else:
            done, self._in_flight = self._in_flight, launched
            if launched is None and done is not None:  # no later launch will collect it: collect it now
                self._device.submit(self._collect_on_device)
        plain = False  # the processed step's rows are the usual case of the persistent batch (_plain_step)
        if done is not None:
            # the step's time for the predictor: all of it when the loop is synchronous (the next step waits
            # for the host work too), the device's alone when the host work overlaps it
            plain = self._process(done, touched, time.perf_counter() - started if self._device is None else None)
        if self.lane is not None and self.lane.has_work():
            for request in self._run_prefill_lane():
                touched[request.parent_id] = None
        if plain and not touched:
            records = self._records_of_plain_step(done)
        else:
            if plain:
                touched.update(zip(map(_PARENT_ID, done.rows), repeat(None)))
            records = self._records(touched)
        if not self._children and self._in_flight is None:
            self._release_runner_state()
        if record is not None:
            listener(dataclasses.replace(record, duration_s=time.perf_counter() - started))
        return records

    def _records(self, touched: dict[str, None]) -> list[Record]:
        """The records of the requests this step touched: per sequence, what is new since its last record. A
        request whose sequences have all ended leaves the engine here."""
        records: list[Record] = []
        add = records.append
        children_of, finished, token_time = self._children, RequestStatus.FINISHED, self._token_time
        for parent in touched:
            children = children_of.get(parent)
            if children is None:  # a stop string ended it since (finish_stopped)
                continue
            all_ended = True
            for child in children:
                ended = child.status is finished
                if not ended:
                    all_ended = False
                    token_ids, sent = child.output_token_ids, child.sent_token_len
                    num_tokens = len(token_ids)
                    if num_tokens == sent:
                        continue  # nothing new for it (with n > 1: a sibling advanced)
                    if child.sent_first_output and child.logprobs is None:  # the usual: new tokens, nothing else
                        child.sent_token_len = num_tokens
                        add(SequenceUpdate(child.request_id, token_ids[sent:]))
                        continue
                record = self._record(child, ended, token_time)
                if record is not None:
                    add(record)
            if all_ended:
                self._retire(parent)
        return records

    def _plain_step(self, rows: list[Request]) -> bool:
        """Whether ``rows``, a step of the scheduler's persistent batch in which no row ended, are the usual case
        there: each with one new token since its last record, no logprobs, past its first record, not reported only
        at its end. Checked once per batch of rows (the same list object while the running set is unchanged): what
        it checks then stays true, since every record of a step covers each of its rows."""
        if rows is self._plain_rows:
            return True
        count = len(rows)
        outputs = list(map(_OUTPUT, rows))
        if (list(map(_LOGPROBS, rows)).count(None) != count or not all(map(_SENT_FIRST, rows))
                or any(map(_REPORTS_AT_END, rows))
                or list(map(sub, map(len, outputs), map(_SENT_LEN, rows))).count(1) != count):
            return False
        self._plain_rows, self._plain_outputs = rows, outputs
        return True

    def _records_of_plain_step(self, step: "_Launched") -> list[Record]:
        """``_records`` for a ``_plain_step``: one record for all its rows, their ids and their one new token each
        (a ``PlainStep``), without bytecode per row."""
        consume(map(setattr, step.rows, repeat("sent_token_len"), map(len, self._plain_outputs)))
        result = step.outcome[0] if step.future is None else step.future.result()[0]
        return [PlainStep(step.batch.request_ids, list(result.sampled_token_ids))]

    @staticmethod
    def _record(child: Request, ended: bool, token_time: float) -> SequenceUpdate | None:
        """``_records``' general case: a sequence's first record (the prompt's outputs, the metrics), its last (its
        end, the metrics, an embedding), one with logprobs; None while a request reports only at its end."""
        token_ids, metrics = child.output_token_ids, child.metrics
        if token_ids and metrics.first_token_time is None:
            metrics.first_token_time = token_time
        if not ended and child.reports_at_end:
            return None
        new = token_ids[child.sent_token_len:]
        child.sent_token_len = len(token_ids)
        logprobs = child.logprobs
        if logprobs:
            child.logprobs = []
        first = not child.sent_first_output
        child.sent_first_output = True
        m = None
        if (first or ended) and child.index == 0:
            m = CoreMetrics(metrics.first_scheduled_time, metrics.first_token_time, metrics.finished_time,
                            metrics.num_preemptions, metrics.predicted_ttft_s)
        embedding = None
        if ended and child.pool and child.pooled_sum is not None:
            embedding = (child.pooled_sum / child.num_prompt_tokens).tolist()
        return SequenceUpdate(child.request_id, new, child.finish_reason if ended else None, child.stop_reason,
                              logprobs or None, child.prompt_logprobs if first else None, embedding, m)

    def _retire(self, parent: str) -> None:
        """Every sequence of the request has ended: it leaves the engine."""
        for child in self._children.pop(parent):
            if self.speculator is not None:
                self.speculator.forget(child.request_id)
            if child.finish_reason in ("stop", "length") and not child.prefill_only:
                self._sum_output_lengths += child.num_output_tokens
                self._num_output_lengths += 1
        self.num_finished_requests += 1

    def finish_stopped(self, request_id: str, stop: str) -> None:
        """A stop string, found by the front end, ended sequence ``request_id``: it ends in the core now (its slot
        and blocks go back before the next step). Unknown or already ended: nothing to do."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return
        request.finish_reason, request.stop_reason = "stop", stop
        self.scheduler.finish(request, "stop")
        parent = request.parent_id
        if all(c.is_finished for c in self._children[parent]):
            self._retire(parent)
        if not self._children and self._in_flight is None:
            self._release_runner_state()

    def _release_runner_state(self) -> None:
        """Idle: what the runner keeps per request (penalty counts) for requests that ended goes now, not with
        the next batch, which may be far off. On the device thread when there is one (it owns that state)."""
        ended = self.scheduler.take_ended_with_state()
        if ended:
            forget = self.runner.sampler.forget
            if self._device is None:
                forget(ended)
            else:
                self._device.submit(forget, ended).result()  # idle: nothing to overlap with

    def _schedule_and_launch(self) -> tuple[SchedulerOutput, "_Launched | None"]:
        """Schedule a batch and start computing it (at once, or on the device thread); the launch is None when
        there is nothing to run."""
        scheduler = self.scheduler
        if self.speculator is not None:  # proposals for the rows that decode: the scheduler adds them to the batch
            self.speculator.propose([r for r in scheduler.running if r.num_computed_tokens == len(r.all_token_ids) - 1])
        batch = scheduler.schedule()
        self.last_batch_size = batch.num_rows
        if batch.is_empty:
            return batch, None
        rows = scheduler.scheduled_requests()
        kept = scheduler.scheduled_by_persistent_batch()
        if kept is not None:  # every row samples; the batch keeps their params and output counts
            sampled_rows, params, counts = rows, kept.params, kept.sampled_output_counts()
        else:
            # Per row of every step from here: locals, and no per-row dict unless a row asked for logprobs.
            sampled_rows = list(compress(rows, batch.sample))
            params = list(map(_PARAMS, sampled_rows))
            # tokens before this one, the ones still in flight included
            counts = [len(r.output_token_ids) + r.num_pending_tokens - 1 for r in sampled_rows]
        sampling = SamplingBatch(params=params, num_output_tokens=counts, eos_token_ids=self.eos_token_ids,
                                 requests=sampled_rows)
        if self._device is None:
            return batch, _Launched(batch, rows, None, self._timed_execute(batch, sampling))
        future: Future = Future()
        self._device.submit(self._launch_on_device, batch, sampling, future)
        return batch, _Launched(batch, rows, future)

    def _launch_on_device(self, batch: SchedulerOutput, sampling: SamplingBatch, done: Future) -> None:
        """The device thread's part of a step: launch it, then collect the step before it, which the device was
        computing meanwhile. A GPU so has this step queued before the host learns the last one's tokens, and runs
        step after step while the host processes outputs and schedules: no gap for the host's work, nor for this
        thread's wait for the GIL (up to the interpreter's switch interval, 5 ms, while the host thread runs
        Python). A step already computed (always, on a CPU, where launching computes it) is handed over at once:
        nothing is gained by holding it."""
        uncollected = self._uncollected
        if uncollected is not None and uncollected[0].done():
            self._collect_on_device()
        try:
            step = self.runner.launch(batch, sampling)
        except BaseException as error:  # the step before is still owed its result
            self._collect_on_device()
            done.set_exception(error)
            return
        self._collect_on_device()
        self._uncollected = (step, done)
        if step.done():
            self._collect_on_device()

    def _collect_on_device(self) -> None:
        """Hand the uncollected step's (result, device seconds) to its future; nothing when there is none."""
        if self._uncollected is None:
            return
        (step, done), self._uncollected = self._uncollected, None
        try:
            result = self.runner.collect(step)
        except BaseException as error:
            done.set_exception(error)
            return
        done.set_result((result, self.runner.device_seconds(step)))

    def _timed_execute(self, batch: SchedulerOutput, sampling: SamplingBatch) -> tuple[RunnerOutput, float]:
        started = time.perf_counter()
        result = self.runner.execute(batch, sampling)
        return result, time.perf_counter() - started

    def _process(self, launched: "_Launched", touched: dict[str, None], step_seconds: float | None) -> bool:
        """Apply a computed step: prompt outputs, tokens (stop rules, stop strings), the predictor's clock
        (``step_seconds``, or the forward's own time when None). The requests that got a token go into ``touched``,
        except after a ``_plain_step`` (returns True): those are its rows, and the caller reports them."""
        scheduler, batch = self.scheduler, launched.batch
        result, seconds = launched.outcome if launched.future is None else launched.future.result()
        if step_seconds is not None:
            seconds = step_seconds
        if result.prompt_outputs:  # before update, which ends the prefill-only requests whose prompt is done
            rows = launched.rows
            for row, prompt_output in result.prompt_outputs.items():
                if not rows[row].is_finished:
                    add_prompt_outputs(rows[row], batch.start_positions[row], prompt_output)
        logprobs, accepted = result.logprobs, result.accepted_token_ids
        self._token_time = time.time()  # when this step's tokens arrived (a first token's time, in _records)
        advanced = scheduler.update(result.sampled_token_ids, accepted)
        if logprobs.count(None) != len(logprobs):  # the raw logprobs wait on their requests until reported
            rows, got_token = launched.rows, set(advanced)
            for row, token_logprobs in enumerate(logprobs):
                request = rows[row]
                if token_logprobs is not None and request.logprobs is not None and request in got_token:
                    request.logprobs.append(token_logprobs)
                    request.logprobs.extend(result.accepted_logprobs.get(row, ()))
        plain = scheduler.last_update_kept and self._plain_step(launched.rows)
        if not plain:
            touched.update(zip(map(_PARENT_ID, advanced), repeat(None)))  # C loops: this runs for every row
        for request in scheduler.drain_ended_without_token():  # prefill-only requests done in this step
            touched[request.parent_id] = None
        self.num_generated_tokens += len(advanced)
        self.num_steps += 1
        # proposed tokens are decode work: the predictor's decode step includes them
        num_decode_rows, num_spec_tokens = batch.num_decode_rows, batch.num_spec_tokens
        num_prompt_tokens = batch.num_tokens - num_decode_rows - num_spec_tokens
        if accepted:
            self.num_generated_tokens += sum(map(len, accepted.values()))
        if self.speculator is not None:
            rows = launched.rows
            verified = [(rows[row], len(proposed), len(accepted.get(row, ())))
                        for row, proposed in batch.spec_token_ids.items()]
            self.speculator.observe(verified, seconds, num_decode_rows, num_prompt_tokens,
                                    self.predictor.per_prefill_token_s if self.predictor is not None else None)
        if self.predictor is not None:
            self.predictor.observe(seconds, num_prompt_tokens, num_decode_rows)
        if self.num_steps % SAMPLE_EVERY == 0:
            self._sample_kv(batch, seconds)
        return plain

    def _run_prefill_lane(self) -> list[Request]:
        """One lane batch, after the scheduler's step (see prefill_lane.py for why); returns the lane requests
        that ended in this step, aborted and timed-out ones included."""
        lane = self.lane
        batch = lane.next_batch()
        if batch:
            prefill_input = lane.batch_input(batch)
            # after any step still computing: one thread owns the device
            results = (self.runner.execute_prefill(prefill_input) if self._device is None
                       else self._device.submit(self.runner.execute_prefill, prefill_input).result())
            for request, prompt_output in zip(batch, results):
                add_prompt_outputs(request, 0, prompt_output)
                lane.finish(request)
        return batch + lane.drain_ended()

    def _record_step(self, batch: SchedulerOutput) -> StepRecord:
        """The state this step runs in, taken before the runner and ``update`` change it."""
        scheduler = self.scheduler
        return StepRecord(
            step_index=self.num_steps,
            batch=batch,
            running_ids=[r.request_id for r in scheduler.running],
            parent_ids={r.request_id: r.parent_id for r in scheduler.running},
            num_waiting=len(scheduler.waiting),
            kv_blocks_used=scheduler.kv.pool.num_used,
            kv_tokens_used=scheduler.kv_stats().num_tokens_used,  # the step's new tokens count as computed
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self._children)

    @property
    def async_scheduling(self) -> bool:
        return self._device is not None

    def stats(self) -> dict[str, Any]:
        kv = self.scheduler.kv_stats()
        return {
            "batching": self.config.batching,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_queued_prompt_tokens": sum(r.num_tokens - r.num_computed_tokens for r in self.scheduler.waiting),
            "kv_blocks_total": kv.num_blocks_total,
            "kv_blocks_used": kv.num_blocks_used,  # live: held by requests
            "kv_blocks_cached": kv.num_blocks_cached,  # idle, holding reusable prefixes, reclaimable
            "kv_blocks_empty": kv.num_blocks_empty,
            "kv_blocks_free": kv.num_blocks_free,  # available to new requests: empty + cached
            "kv_block_usage": kv.block_usage,
            "kv_token_usage": kv.token_usage,
            "block_size": self.config.block_size,
            "max_num_seqs": self.config.max_num_seqs,
            "max_model_len": self.max_model_len,
            "num_prefill_lane_waiting": len(self.lane.waiting) if self.lane is not None else 0,
            "num_prefill_lane_batches": self.lane.num_batches if self.lane is not None else 0,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_recomputed_tokens": self.scheduler.num_recomputed_tokens,
            "num_swapped_out_bytes": self.scheduler.num_swapped_out_blocks * self.runner.kv_bytes_per_block,
            "num_swapped_in_bytes": self.scheduler.num_swapped_in_blocks * self.runner.kv_bytes_per_block,
            "prefix_cache_query_tokens": self.scheduler.num_prefix_query_tokens,
            "prefix_cache_hit_tokens": self.scheduler.num_prefix_hit_tokens,
            # None, or why token-level KV use stays under 60% while requests wait (kv_diagnosis.py)
            "kv_diagnosis": self.kv_diagnosis.message if self.kv_diagnosis is not None else None,
            "kv_diagnosis_cause": self.kv_diagnosis.cause if self.kv_diagnosis is not None else None,
            "num_steps": self.num_steps,
            "batch_size": self.last_batch_size,
            "num_generated_tokens": self.num_generated_tokens,
            "num_finished_requests": self.num_finished_requests,
            **(self.speculator.stats() if self.speculator is not None else {}),
            "time": time.time(),
        }


def add_prompt_outputs(request: Request, start: int, output: PromptOutput) -> None:
    """A prompt chunk from position ``start``: its prompt tokens' raw logprobs and its pooled hidden states."""
    if output.logprobs is not None:
        assert len(request.prompt_logprobs) == start + 1, "prompt logprobs must arrive chunk after chunk"
        request.prompt_logprobs.extend(output.logprobs)
    if output.pooled_sum is not None:
        pooled = request.pooled_sum
        request.pooled_sum = output.pooled_sum if pooled is None else pooled + output.pooled_sum
