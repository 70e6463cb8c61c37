"""The synchronous engine: schedule, run, process outputs — one step at a time."""

from __future__ import annotations

import dataclasses
import logging
import time
from itertools import compress, repeat
from operator import attrgetter
from typing import Any, Callable, Iterable

from inflight.engine.config import EngineConfig
from inflight.engine.grammar_wait import GrammarWait
from inflight.engine.kv_diagnosis import EngineLimits, KVWatch, StepSample
from inflight.engine.models.packaged import DEFAULT_MODEL
from inflight.engine.models.source import read_model_source
from inflight.engine.model_len import fit_to_pool, model_limit
from inflight.engine.model_runner import ModelRunner
from inflight.engine.core_messages import Record
from inflight.engine.core_records import CoreRecords
from inflight.engine.output_processor import OutputProcessor
from inflight.engine.outputs import RequestOutput
from inflight.engine.prefill_lane import PrefillLane
from inflight.engine.request import Continuation, Request
from inflight.engine.sampler import SamplingBatch
from inflight.engine.sampling_params import PoolingParams, SamplingParams
from inflight.engine.scheduler import make_scheduler
from inflight.engine.scheduler_output import SchedulerOutput, StepRecord
from inflight.engine.speculative import draft_budget, make_speculator
from inflight.engine.request_maker import PromptInput, RequestMaker
from inflight.engine.step_launcher import Launched, StepLauncher
from inflight.engine.ttft_predictor import (OutputLengths, QueueView, Rank, TTFTPredictor, check_deadline, predicts_for,
                                            take_queue_view)

logger = logging.getLogger(__name__)

_PARENT_ID, _PARAMS = attrgetter("parent_id"), attrgetter("params")


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
        wanted = self.config.max_model_len
        self.max_model_len = model_limit(source.config, wanted)
        self.runner = ModelRunner(self.config, source, self.max_model_len, draft_budget(self.config))
        self.config = self.runner.config  # the attention backend may have raised block_size
        self.max_model_len, self._max_model_len_note = fit_to_pool(self.max_model_len, wanted,
                                                                   self.runner.num_kv_blocks, self.config.block_size)
        self.scheduler = make_scheduler(self.config, self.runner.num_kv_blocks, self.runner.kv_window)
        self.scheduler.long_rope_length = self.model_config.long_rope_length
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
        preemption, runner = self.scheduler.preemption, self.runner
        preemption.set_swap_space(runner.num_swap_blocks)
        preemption.use_measured_costs(runner.kv_bytes_per_block, runner.swap_bytes_per_s,
                                      lambda: None if self.predictor is None else self.predictor.per_prefill_token_s)
        self._output_lengths = OutputLengths()  # of finished requests, for admission's estimate of remaining work
        config = self.config
        self.kv_watch = KVWatch(EngineLimits(config.batching, config.max_num_seqs, config.max_num_batched_tokens,
                                             self.runner.num_kv_blocks, config.block_size))
        self._children: dict[str, list[Request]] = {}  # request id -> its n sequences
        self.num_steps = 0
        self._token_time = 0.0  # when the latest step's tokens arrived
        self._records = CoreRecords()
        self.last_batch_size = 0  # rows computed by the latest step
        self.num_finished_requests = 0
        self.num_generated_tokens = 0
        # Called at the end of every step with what it did; off (None) unless a benchmark or tracer sets it.
        self.step_listener: Callable[[StepRecord], None] | None = None
        # Async scheduling: the forwards on a device thread, one step ahead (step_launcher.py).
        use_async = (config.async_scheduling if config.async_scheduling is not None
                     else config.batching == "continuous" and self.runner.device.type == "cuda"
                     and config.speculative_config is None)
        self._launcher = StepLauncher(self.runner, on_device_thread=use_async)
        self._in_flight: Launched | None = None  # with async scheduling: the step launched, not yet processed
        self.speculator = make_speculator(self.config, self.max_model_len, self.model_config.vocab_size,
                                          self.runner.num_kv_blocks, self.eos_token_ids)
        self.scheduler.speculative = self.speculator is not None
        # Requests whose structured output compiles on a pool thread (the step loop does not wait for it).
        self._grammars = GrammarWait(self.runner.sampler.constraints)

    def _kv_sample(self, batch: SchedulerOutput, seconds: float) -> StepSample:
        """This step for the KV diagnosis (the seed's advice: token-level KV use under 60% while requests wait means
        a limit other than memory is hit)."""
        scheduler = self.scheduler
        padding = sum(batch.padding)
        decode = batch.num_decode_rows - padding
        num_spec_tokens = batch.num_spec_tokens
        return StepSample(seconds, batch.num_tokens - decode - padding - num_spec_tokens, decode, padding,
                          len(scheduler.running), len(scheduler.waiting), scheduler.kv.pool.num_used,
                          scheduler.kv_stats().num_tokens_used, num_spec_tokens)

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
            self._grammars.add(requests, constraint)
            return
        self._queue(requests)

    def _queue(self, requests: list[Request]) -> None:
        queue = self.lane if self.lane is not None and requests[0].prefill_only else self.scheduler
        for request in requests:
            queue.add(request)

    def _take_compiled(self, touched: dict[str, None]) -> None:
        """Requests whose grammar has compiled join the queue; those that ended waiting for it are reported."""
        ready, ended = self._grammars.take(idle=not self.scheduler.has_unfinished())
        for requests in ready:
            self._queue(requests)
        touched.update(dict.fromkeys(ended))

    def queue_view(self) -> QueueView | None:
        """The queue as admission sees it (``ttft_predictor.take_queue_view``). From the step thread only."""
        return take_queue_view(self.predictor, self.scheduler, self._output_lengths, time.time(),
                               self.config.scheduling_policy == "priority")

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
        if self._grammars.abort(request_id):  # not queued yet: it ends with the next step's outputs
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
        if self._grammars:  # before scheduling: a grammar ready now is admitted now
            self._take_compiled(touched)
        batch, launched = self._schedule_and_launch()
        record = StepRecord.take(self.num_steps, batch, scheduler) if listener is not None else None  # empty steps too: they take time
        touched.update(dict.fromkeys(r.parent_id for r in scheduler.drain_ended_without_token()))
        if not self._launcher.on_device_thread:
            done = launched
        else:
            done, self._in_flight = self._in_flight, launched
            if launched is None and done is not None:  # no later launch will collect it: collect it now
                self._launcher.collect_soon()
        plain = False  # the processed step's rows are the usual case of the persistent batch (_plain_step)
        if done is not None:
            # the step's time for the predictor: all of it when the loop is synchronous (the next step waits
            # for the host work too), the device's alone when the host work overlaps it
            plain = self._process(done, touched,
                                  None if self._launcher.on_device_thread else time.perf_counter() - started)
        if self.lane is not None and self.lane.has_work():
            for request in self._run_prefill_lane():
                touched[request.parent_id] = None
        if plain and not touched:
            records = self._records.of_plain_step(done)
        else:
            if plain:
                touched.update(zip(map(_PARENT_ID, done.rows), repeat(None)))
            records = self._records.of_touched(touched, self._children, self._token_time, self._retire)
        if not self._children and self._in_flight is None:
            self._release_runner_state()
        if record is not None:
            listener(dataclasses.replace(record, duration_s=time.perf_counter() - started))
        return records

    def _retire(self, parent: str) -> None:
        """Every sequence of the request has ended: it leaves the engine."""
        for child in self._children.pop(parent):
            if self.speculator is not None:
                self.speculator.forget(child.request_id)
            if child.finish_reason in ("stop", "length") and not child.prefill_only:
                self._output_lengths.record(child.num_output_tokens)
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
            self._launcher.run_on_device(self.runner.sampler.forget, ended)  # idle: nothing to overlap with

    def _schedule_and_launch(self) -> tuple[SchedulerOutput, Launched | None]:
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
        return batch, self._launcher.launch(batch, rows, sampling)

    def _process(self, launched: Launched, touched: dict[str, None], step_seconds: float | None) -> bool:
        """Apply a computed step: prompt outputs, tokens (stop rules, stop strings), the predictor's clock
        (``step_seconds``, or the forward's own time when None). The requests that got a token go into ``touched``,
        except after a ``_plain_step`` (returns True): those are its rows, and the caller reports them."""
        scheduler, batch = self.scheduler, launched.batch
        result, seconds = launched.result()
        if step_seconds is not None:
            seconds = step_seconds
        if result.prompt_outputs:  # before update, which ends the prefill-only requests whose prompt is done
            rows = launched.rows
            for row, prompt_output in result.prompt_outputs.items():
                if not rows[row].is_finished:
                    rows[row].add_prompt_outputs(batch.start_positions[row], prompt_output)
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
        plain = scheduler.kept.last_update_kept and self._records.is_plain_step(launched.rows)
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
        self.kv_watch.observe(self.num_steps, lambda: self._kv_sample(batch, seconds))
        return plain

    def _run_prefill_lane(self) -> list[Request]:
        """One lane batch, after the scheduler's step (see prefill_lane.py for why); returns the lane requests
        that ended in this step, aborted and timed-out ones included."""
        lane = self.lane
        batch = lane.next_batch()
        if batch:
            prefill_input = lane.batch_input(batch)
            # after any step still computing: one thread owns the device
            results = self._launcher.run_on_device(self.runner.execute_prefill, prefill_input)
            for request, prompt_output in zip(batch, results):
                request.add_prompt_outputs(0, prompt_output)
                lane.finish(request)
        return batch + lane.drain_ended()

    def has_unfinished_requests(self) -> bool:
        return bool(self._children)

    @property
    def async_scheduling(self) -> bool:
        return self._launcher.on_device_thread

    def check_ranks(self) -> None:
        """``engine.parallel.shm.PeerLost`` if one of the model's other tensor-parallel ranks has died."""
        self.runner.check_ranks()

    def close(self) -> None:
        """Stop the model's other tensor-parallel ranks, if any (idempotent; also done when the engine is collected
        or the process exits)."""
        self.runner.close()

    def stats(self) -> dict[str, Any]:
        kv, preemption, diagnosis = self.scheduler.kv_stats(), self.scheduler.preemption, self.kv_watch.diagnosis
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
            # the sliding-window layers' own blocks, where they keep only their windows (0 and 0 where not)
            "kv_window_blocks_total": self.runner.num_window_blocks,
            "kv_window_blocks_used": self.scheduler.kv.window_blocks_used(),
            "block_size": self.config.block_size,
            "max_num_seqs": self.config.max_num_seqs,
            "max_model_len": self.max_model_len,
            "num_prefill_lane_waiting": len(self.lane.waiting) if self.lane is not None else 0,
            "num_prefill_lane_batches": self.lane.num_batches if self.lane is not None else 0,
            "num_preemptions": preemption.num_preemptions,
            "num_recomputed_tokens": preemption.num_recomputed_tokens,
            "num_swapped_out_bytes": preemption.num_swapped_out_blocks * self.runner.kv_bytes_per_block,
            "num_swapped_in_bytes": preemption.num_swapped_in_blocks * self.runner.kv_bytes_per_block,
            "prefix_cache_query_tokens": self.scheduler.num_prefix_query_tokens,
            "prefix_cache_hit_tokens": self.scheduler.num_prefix_hit_tokens,
            # None, or why token-level KV use stays under 60% while requests wait (kv_diagnosis.py)
            "kv_diagnosis": diagnosis.message if diagnosis is not None else None,
            "kv_diagnosis_cause": diagnosis.cause if diagnosis is not None else None,
            "num_steps": self.num_steps,
            "batch_size": self.last_batch_size,
            "num_generated_tokens": self.num_generated_tokens,
            "num_finished_requests": self.num_finished_requests,
            **(self.speculator.stats() if self.speculator is not None else {}),
            "time": time.time(),
        }

