"""Runs one step on the device: scheduler output in, sampled token ids out (lists, not tensors).

Owns the model, the paged KV cache tensors and the sampler. Input preparation is vectorised
with numpy: no Python loop over rows.

A step is launched, then collected (``launch``, ``collect``; ``execute`` is both). Launching queues the
step's device work and returns; a greedy step's tokens stay on the device until it is collected, so the
next step can be launched behind it before they reach the host: its rows that decode a token not yet known
on the host (async scheduling's placeholders) read it from the device. The GPU then runs step after step
while the host does the rest.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from inflight.engine.config import EngineConfig
from inflight.engine.cuda_graphs import DecodeGraphs
from inflight.engine.device import choose_dtype, resolve_device
from inflight.engine.kv_budget import SharedBudget, count_kv_blocks
from inflight.engine.models.cpu_decode import FusedDecode
from inflight.engine.models.cpu_packing import pack_expert_weights, pack_linear_weights
from inflight.engine.models.llama import CausalLM, Experts
from inflight.engine.models.loader import build_model
from inflight.engine.models.quantized import weight_bytes
from inflight.engine.models.source import ModelSource
from inflight.engine.models.tensor_parallel import Shard, check_tensor_parallel_size
from inflight.engine.parallel.ranks import TensorParallel, start_ranks
from inflight.engine.prompt_outputs import PromptOutput, prompt_outputs
from inflight.engine.sampler import Sampler, SamplingBatch, TokenLogprobs
from inflight.engine.structured_output import GrammarCompiler
from inflight.engine.scheduler_output import PrefillBatch, SchedulerOutput
from inflight.kernels import BatchLayout, get_attention_backend
from inflight.kernels.dense_prefill import DensePrefillMetadata

logger = logging.getLogger(__name__)



@dataclass
class StepArrays:
    """One step's inputs as host arrays, before they go to the device (eagerly, or into graph buffers)."""

    positions: np.ndarray  # [num_tokens]
    seq_lens: np.ndarray  # [num_rows]
    tables: np.ndarray  # [num_rows, max_blocks]
    slots: np.ndarray  # [num_tokens]
    logits_index: np.ndarray  # [num_sampling_rows]: the token whose hidden state each sampling row reads
    all_decode: bool
    window_tables: np.ndarray | None = None  # the same for the sliding-window layers' caches, where apart
    window_slots: np.ndarray | None = None


@dataclass
class LaunchedStep:
    """A step whose device work is queued. ``output`` is complete except for the tokens of ``sample_rows`` when
    ``tokens`` is set: a greedy step's argmax, still on the device, with its copy to the host (``host_tokens``)
    complete once ``ready`` has fired (None on a CPU, where launching computed it)."""

    output: "RunnerOutput"
    request_ids: list[str]
    sample_rows: list[int]
    tokens: torch.Tensor | None = None  # [len(sample_rows)] int64 on the device
    host_tokens: torch.Tensor | None = None
    started: torch.cuda.Event | None = None
    ready: torch.cuda.Event | None = None
    launch_seconds: float = 0.0  # the host's time in launch(): the step's whole time where launching computes it

    def done(self) -> bool:
        """Whether the device has finished it (collecting it would not wait)."""
        return self.tokens is None or self.ready is None or self.ready.query()


@dataclass
class RunnerOutput:
    sampled_token_ids: list[int | None]  # one per row; None for rows that do not sample
    logprobs: list[TokenLogprobs | None]  # one per row
    prompt_outputs: dict[int, PromptOutput] = dataclasses.field(default_factory=dict)  # by row, for prompt_rows
    # Rows that verified proposed tokens (SchedulerOutput.spec_token_ids): the tokens they emit after their
    # sampled one (the accepted proposals but the first, then the token sampled after them), with logprobs.
    accepted_token_ids: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    accepted_logprobs: dict[int, list[TokenLogprobs | None]] = dataclasses.field(default_factory=dict)


class ModelRunner:
    """One rank's runner. With ``tensor_parallel_size`` > 1, rank 0 (built without ``parallel``) starts the other
    ranks' processes, each building a runner of its own with ``parallel`` given; rank 0 sends each step to them
    (``engine.parallel.ranks``) and alone samples (the others' ``sampler`` is None)."""

    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int,
                 shared: SharedBudget | None = None, parallel: TensorParallel | None = None,
                 window_kv: bool = True) -> None:
        """``window_kv``: keep the sliding-window layers' KV apart, only their windows (block_pool.py), where the
        model has such layers; not under tensor parallelism yet (every rank would have to size its window caches
        alike, as it does its block tables), nor for a draft model (its KV follows the target's block tables)."""
        self.config = config
        self.shared = shared
        self.window_kv = window_kv and parallel is None and config.tensor_parallel_size == 1
        if parallel is None and config.tensor_parallel_size > 1:
            check_tensor_parallel_size(source.config, config.tensor_parallel_size)
            backend, cuda = config.tensor_parallel_backend, resolve_device(config.device).type == "cuda"
            if backend != "auto" and (backend == "nccl") != cuda:
                raise ValueError(f"tensor_parallel_backend: {backend!r} carries {'GPU' if backend == 'nccl' else 'CPU'} "
                                 f"tensors, and the model runs on {'a GPU' if cuda else 'the CPU'}")
            parallel = start_ranks(config, max_model_len)  # the workers load while this rank does
        self.parallel = parallel
        try:
            self._build(config, source, max_model_len)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig, source: ModelSource, max_model_len: int) -> None:
        parallel = self.parallel
        self.device = resolve_device(config.device)
        self.dtype, why = choose_dtype(config.dtype, source.config.torch_dtype, self.device)
        logger.info("running in %s (%s)", str(self.dtype).removeprefix("torch."), why)
        self._threads = None  # (thread, count) the last step ran on, where steps may change the count
        if self.device.type == "cpu":
            threads = config.num_threads or (parallel.threads if parallel is not None else None)
            if threads is not None:
                torch.set_num_threads(threads)
            if config.one_thread_max_tokens > 0:
                self._all = torch.get_num_threads()
                self._threads = (None, self._all)
        variants = bool(source.config.sliding_layers or source.config.attention_softcap)
        self.backend = get_attention_backend(config.attention_backend, self.device, self.dtype, variants)
        multiple = self.backend.block_size_multiple
        if config.block_size % multiple:
            # e.g. flash-attn's paged KV wants blocks of 256 tokens; the engine reads the adjusted config back
            self.config = config = dataclasses.replace(config, block_size=-(-config.block_size // multiple) * multiple)
        self.block_size = config.block_size
        quantization = config.quantization
        if parallel is not None and quantization == "auto" and source.weight_format == "gguf":
            quantization = "none"  # the cut works on plain weights (GGUF Q4/Q8 kept whole: a later change)
            logger.info("tensor parallel: a GGUF file's weights are dequantized")
        shard = Shard.of(source.config, parallel.rank, parallel.size) if parallel is not None else None
        self.model: CausalLM = build_model(source, self.backend, max_model_len, self.dtype, self.device,
                                           config.load_format, quantization, shard,
                                           parallel.comm if parallel is not None else None)
        self.heads, self.kv_heads = source.config.num_heads, source.config.num_kv_heads  # this rank's
        if shard is not None:
            self.heads, self.kv_heads = shard.heads, shard.kv_heads
        logger.info("model weights: %.1f MB in memory", weight_bytes(self.model) / 1e6)  # (quantized ones as kept)
        if self.backend.name in ("triton", "flash_attn"):  # a GPU's kernels (Triton's interpreter on a CPU)
            for module in self.model.modules():
                if isinstance(module, Experts):
                    module.use_triton()  # a MoE layer's experts in two grouped-GEMM launches
        if self.device.type == "cpu":
            pack_linear_weights(self.model)  # faster decode-sized matmuls (see cpu_packing.py)
            pack_expert_weights(self.model)  # a MoE layer's experts in one call (bf16)
            if self.dtype == torch.bfloat16 and self.backend.elementwise_ops() is not None:
                self.model.residual_dtype = torch.float32  # the CPU kernels' norm keeps it (CausalLM.residual_dtype)
                if parallel is None:  # (its one C++ call has no place for the ranks' all-reduces)
                    self.model.fused_decode = FusedDecode.for_model(self.model, self.backend)  # None: layer by layer
        self.model_config = source.config
        # The layers whose KV lives apart, only their windows (block_pool.py), and that window
        self.window_layers = frozenset(source.config.sliding_layers) if self.window_kv else frozenset()
        self.num_kv_blocks, self.num_window_blocks = count_kv_blocks(self, max_model_len)
        if parallel is not None:  # every rank as many blocks: as many as the rank with least room holds
            self.num_kv_blocks = parallel.shm.min_int(self.num_kv_blocks)
            if parallel.workers is not None:
                parallel.workers.joined()  # (every rank has attached the shared memory: its files go)
        # The extra last block is scratch: static-mode padding rows write there and nobody reads it (in the window
        # caches also the entry of a block given back).
        self.kv_caches = [self._kv_cache(self.num_window_blocks if layer in self.window_layers else self.num_kv_blocks)
                          for layer in range(source.config.num_layers)]
        self.scratch_slot = self.num_kv_blocks * self.block_size
        self.window_scratch_slot = self.num_window_blocks * self.block_size
        vocab_size = source.config.vocab_size
        self.sampler = (Sampler(config.seed, lambda: GrammarCompiler(source.tokenizer, vocab_size,
                                                                     source.eos_token_ids))
                        if parallel is None or parallel.rank == 0 else None)
        # Host memory for preempted requests' KV (swapping), in the device cache's layout, block for block (not
        # for the window caches' blocks: a model with them recomputes what it preempts).
        self.num_swap_blocks = config.swap_space_bytes // self.kv_bytes_per_block if not self.window_layers else 0
        if parallel is not None:
            self.num_swap_blocks = parallel.shm.min_int(self.num_swap_blocks)
        host_shape = self.backend.kv_cache_shape(self.num_swap_blocks, self.block_size, self.kv_heads,
                                                 source.config.head_dim)
        pin = self.device.type == "cuda"
        self.swap_caches = [(_reserved(torch.zeros(host_shape, dtype=self.dtype, pin_memory=pin)),
                             _reserved(torch.zeros(host_shape, dtype=self.dtype, pin_memory=pin)))
                            for _ in range(source.config.num_layers)] if self.num_swap_blocks else []
        self.swap_bytes_per_s = self._measure_swap_rate() if self.num_swap_blocks else 0.0
        self.graphs: DecodeGraphs | None = None
        self._last_launched: LaunchedStep | None = None  # where a placeholder row of the next step finds its token
        if self.device.type == "cuda":
            cfg = source.config
            tune = getattr(self.backend, "tune_decode", None)
            if tune is not None:  # before capture: graphs freeze the launch configuration
                tune(self.heads, self.kv_heads, cfg.head_dim, self.block_size, self.dtype)
            # (not under tensor parallelism yet: a graph would have to capture the ranks' collectives)
            # (nor with window caches: a graph's metadata holds one block table)
            if (not config.enforce_eager and parallel is None and not self.window_layers
                    and getattr(self.backend, "supports_cuda_graphs", False)):
                self.graphs = DecodeGraphs(self.model, self.backend, self.kv_caches, config.max_num_seqs,
                                           max_model_len, self.block_size, self.scratch_slot, self.device)

    def _kv_cache(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = self.backend.kv_cache_shape(num_blocks + 1, self.block_size, self.kv_heads, self.model_config.head_dim)
        return (_reserved(torch.zeros(shape, dtype=self.dtype, device=self.device)),
                _reserved(torch.zeros(shape, dtype=self.dtype, device=self.device)))

    @property
    def kv_window(self) -> tuple[int, int] | None:
        """(the sliding window, the window caches' blocks) where those layers' KV lives apart, else None."""
        return (self.model_config.sliding_window, self.num_window_blocks) if self.window_layers else None

    @property
    def kv_layer_block_bytes(self) -> int:
        """A block of one layer's K and V, of this rank (its KV heads)."""
        return 2 * self.block_size * self.kv_heads * self.model_config.head_dim * self.dtype.itemsize

    @property
    def kv_bytes_per_block(self) -> int:
        """A block of the block tables': every layer's but those whose KV lives in the window caches."""
        return (self.model_config.num_layers - len(self.window_layers)) * self.kv_layer_block_bytes

    def check_ranks(self) -> None:
        """``PeerLost`` if another tensor-parallel rank has died (rank 0; an idle engine looks now and then)."""
        if self.parallel is not None and self.parallel.workers is not None:
            self.parallel.workers.check()

    def close(self) -> None:
        """Stop the other ranks, if any (idempotent)."""
        if self.parallel is not None:
            self.parallel.close()

    def _measure_swap_rate(self) -> float:
        """Bytes per second of one block copy out to the host and back (what choosing swap over recompute weighs)."""
        blocks = torch.arange(min(self.num_swap_blocks, self.num_kv_blocks, 64))
        pairs = list(zip(blocks.tolist(), blocks.tolist()))
        self.copy_blocks(pairs, [])  # warm-up
        started = time.perf_counter()
        self.copy_blocks(pairs, pairs)
        seconds = max(time.perf_counter() - started, 1e-9)
        return 2 * len(pairs) * self.kv_bytes_per_block / seconds

    @torch.inference_mode()
    def copy_blocks(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Preempted requests' KV to host blocks, then resumed requests' KV back into their new device blocks."""
        dim = self.backend.block_dim
        if swap_out:
            device_blocks = torch.tensor([d for d, _ in swap_out], device=self.device)
            host_blocks = torch.tensor([h for _, h in swap_out])
            for cache, host in zip(self.kv_caches, self.swap_caches):
                for device_tensor, host_tensor in zip(cache, host):
                    host_tensor.index_copy_(dim, host_blocks, device_tensor.index_select(dim, device_blocks).cpu())
        if swap_in:
            host_blocks = torch.tensor([h for h, _ in swap_in])
            device_blocks = torch.tensor([d for _, d in swap_in], device=self.device)
            for cache, host in zip(self.kv_caches, self.swap_caches):
                for device_tensor, host_tensor in zip(cache, host):
                    device_tensor.index_copy_(dim, device_blocks,
                                              host_tensor.index_select(dim, host_blocks).to(self.device, non_blocking=True))

    def execute(self, batch: SchedulerOutput, sampling: SamplingBatch) -> RunnerOutput:
        return self.collect(self.launch(batch, sampling))

    @torch.inference_mode()
    def launch(self, batch: SchedulerOutput, sampling: SamplingBatch | None, greedy: bool = False) -> LaunchedStep:
        """Queue one step's device work. Tokens come back at once (on the host) unless every sampling row is
        plain greedy: then they stay on the device until ``collect``, and the next launch may come first.
        ``sampling`` None: a tensor-parallel rank other than 0, told by rank 0 whether the step is ``greedy``."""
        started = time.perf_counter()
        cuda = self.device.type == "cuda"
        start_event = recorded_event() if cuda else None
        workers = self.parallel.workers if self.parallel is not None else None
        if workers is not None:
            workers.send_step(batch, sampling.all_greedy_plain)  # the other ranks compute it beside this one
        if batch.swap_out or batch.swap_in:
            self.copy_blocks(batch.swap_out, batch.swap_in)
        if batch.ended_ids and self.sampler is not None:
            self.sampler.forget(batch.ended_ids)
        if self._threads is not None:
            self._use_threads(len(batch.input_token_ids))
        arrays = self._prepare(batch)
        logits_index = torch.from_numpy(arrays.logits_index).to(self.device, non_blocking=True)
        input_ids = self._input_ids(batch)
        if self.parallel is not None and batch.placeholder_rows:
            self.parallel.comm.broadcast(input_ids)  # tokens only rank 0 has sampled (async scheduling)
        if self.graphs is not None and arrays.all_decode and self.graphs.fits(batch.num_rows):
            hidden = self.graphs.run(input_ids, arrays.positions, arrays.slots, arrays.tables, arrays.seq_lens)
        else:
            to = lambda a: torch.from_numpy(a).to(self.device)  # noqa: E731
            layout = BatchLayout(query_lens=batch.query_lens, seq_lens=arrays.seq_lens.tolist(),
                                 block_tables=to(arrays.tables), slot_mapping=to(arrays.slots),
                                 block_size=self.block_size)
            window_metadata = None
            if arrays.window_tables is not None:  # the sliding-window layers read their own caches' tables
                window_metadata = self.backend.prepare(dataclasses.replace(
                    layout, block_tables=to(arrays.window_tables), slot_mapping=to(arrays.window_slots)))
            hidden = self.model(input_ids, to(arrays.positions), self.kv_caches, self.backend.prepare(layout),
                                window_metadata)
        sampled: list[int | None] = [None] * batch.num_rows
        logprobs: list[TokenLogprobs | None] = [None] * batch.num_rows
        sample_rows = [i for i, s in enumerate(batch.sample) if s]
        output = RunnerOutput(sampled, logprobs)
        step = LaunchedStep(output, batch.request_ids, sample_rows, started=start_event)
        if sample_rows and batch.spec_token_ids:
            self._verify(hidden, batch, sample_rows, sampling, output)
        elif sample_rows and (sampling.all_greedy_plain if sampling is not None else greedy):
            # every row plain greedy: its token as a tensor where the logits are, without waiting for them
            # (collect() brings them to the host); under tensor parallelism only each rank's best crosses over
            tokens = self.model.greedy_tokens(hidden[logits_index])
            if tokens is not None:  # (None on a rank other than 0)
                step.tokens = tokens
                step.host_tokens = tokens.to("cpu", non_blocking=True) if cuda else tokens
        elif sample_rows:
            logits = self.model.compute_logits(hidden[logits_index])
            if logits is not None:  # (None on a rank other than 0: it only takes part in computing them)
                token_ids, token_logprobs = self.sampler(logits, sampling)
                for row, token_id, lp in zip(sample_rows, token_ids, token_logprobs):
                    sampled[row] = token_id
                    logprobs[row] = lp
        if batch.prompt_rows:
            output.prompt_outputs = prompt_outputs(self.model, hidden, batch.input_token_ids, batch.query_lens,
                                                         batch.prompt_rows)
        if cuda:
            step.ready = recorded_event()
        self._last_launched = step
        step.launch_seconds = time.perf_counter() - started
        return step

    def _use_threads(self, num_tokens: int) -> None:
        """One thread for a step of at most ``one_thread_max_tokens`` tokens, else the configured count. Set on the
        thread that runs the forward (OpenMP's count is per calling thread); a change costs about a microsecond."""
        wanted = (threading.get_ident(),
                  1 if num_tokens <= self.config.one_thread_max_tokens else (self.config.num_threads or self._all))
        if wanted != self._threads:
            torch.set_num_threads(wanted[1])
            self._threads = wanted

    @staticmethod
    def collect(step: LaunchedStep) -> RunnerOutput:
        """A launched step's output, once its tokens are on the host (waits for the device if need be)."""
        if step.tokens is not None:
            if step.ready is not None:
                step.ready.synchronize()  # without the GIL: the host thread runs meanwhile
            sampled = step.output.sampled_token_ids
            for row, token_id in zip(step.sample_rows, step.host_tokens.tolist()):
                sampled[row] = token_id
            step.tokens = None  # collected: the device tensor can go
        return step.output

    @staticmethod
    def device_seconds(step: LaunchedStep) -> float:
        """A collected step's time on the device: from its start there to its tokens (on a CPU, its launch)."""
        if step.started is None or step.ready is None:
            return step.launch_seconds
        return step.started.elapsed_time(step.ready) / 1e3

    def _verify(self, hidden: torch.Tensor, batch: SchedulerOutput, sample_rows: list[int], sampling: SamplingBatch,
                output: RunnerOutput) -> None:
        """A step with proposed tokens: logits at a verifying row's last token and at each proposal (the last
        ``1 + k`` tokens of its row), one verification for the batch (``Sampler.verify``)."""
        spec = batch.spec_token_ids
        token_ends = np.cumsum(batch.query_lens).tolist()
        index: list[int] = []
        proposed: list[list[int]] = []
        for row in sample_rows:
            guesses = spec.get(row, [])
            index.extend(range(token_ends[row] - 1 - len(guesses), token_ends[row]))
            proposed.append(guesses)
        logits = self.model.compute_logits(hidden[torch.tensor(index, device=self.device)])
        if logits is None:  # a rank other than 0
            return
        emitted, emitted_logprobs = self.sampler.verify(logits, sampling, proposed)
        for row, tokens, lps in zip(sample_rows, emitted, emitted_logprobs):
            output.sampled_token_ids[row] = tokens[0]
            output.logprobs[row] = lps[0]
            if row in spec:
                output.accepted_token_ids[row] = tokens[1:]
                output.accepted_logprobs[row] = lps[1:]

    def _input_ids(self, batch: SchedulerOutput) -> torch.Tensor:
        """The step's token ids on the device. Async scheduling: a decode row scheduled before its input token was
        sampled takes it from the step launched before this one (steps run in order, and a pending token is always
        the previous step's), on the host when that step's tokens are there, else on the device."""
        rows, last = batch.placeholder_rows, self._last_launched
        if not rows or self.sampler is None:  # (a rank other than 0 gets the placeholders' tokens from rank 0)
            return torch.from_numpy(np.asarray(batch.input_token_ids, dtype=np.int64)).to(self.device, non_blocking=True)
        position = {request_id: i for i, request_id in enumerate(map(last.request_ids.__getitem__, last.sample_rows))}
        source = [position[batch.request_ids[row]] for row in rows]
        num_tokens = len(batch.input_token_ids)
        if last.tokens is not None and len(source) == len(last.sample_rows) == num_tokens \
                and source == list(range(num_tokens)):
            return last.tokens  # the usual decode step: every row, in the order of the step before (read, not written)
        input_ids = np.asarray(batch.input_token_ids, dtype=np.int64)
        token_index = (np.cumsum(batch.query_lens) - 1)[rows]  # a placeholder row is a decode row: its one token
        if last.tokens is None:  # known on the host
            sampled = last.output.sampled_token_ids
            input_ids[token_index] = [sampled[last.sample_rows[i]] for i in source]
            return torch.from_numpy(input_ids).to(self.device, non_blocking=True)
        ids = torch.from_numpy(input_ids).to(self.device, non_blocking=True)
        to = lambda a: torch.as_tensor(a, dtype=torch.int64).to(self.device, non_blocking=True)  # noqa: E731
        ids[to(token_index)] = last.tokens[to(source)]
        return ids

    @torch.inference_mode()
    def execute_prefill(self, batch: PrefillBatch) -> list[PromptOutput]:
        """A prefill-only lane batch: whole prompts in one forward that touches no KV cache (no blocks,
        no slots), attended by ``kernels.dense_prefill``. One output per prompt."""
        if self.parallel is not None and self.parallel.workers is not None:
            self.parallel.workers.send_prefill(batch)
        query_lens = [len(ids) for ids in batch.token_ids]
        flat = list(itertools.chain.from_iterable(batch.token_ids))
        input_ids = torch.tensor(flat, dtype=torch.long, device=self.device)
        long_length, offset = self.model_config.long_rope_length, self.model.rotary.long_offset
        positions = torch.from_numpy(np.concatenate([  # (a LongRoPE prompt past its original length: rotated long)
            np.arange(n) + (offset if long_length is not None and n > long_length else 0) for n in query_lens]))
        hidden = self.model(input_ids, positions.to(self.device), None, DensePrefillMetadata(query_lens))
        outputs = prompt_outputs(self.model, hidden, flat, query_lens, dict(enumerate(batch.rows)))
        return [outputs[row] for row in range(len(query_lens))]

    def _prepare(self, batch: SchedulerOutput) -> StepArrays:
        bs = self.block_size
        query_lens = np.asarray(batch.query_lens, dtype=np.int64)
        starts = np.asarray(batch.start_positions, dtype=np.int64)
        seq_lens = starts + query_lens
        token_ends = np.cumsum(query_lens)
        row_of_token = np.repeat(np.arange(batch.num_rows), query_lens)
        # position of each token = its row's start + its offset inside the row
        positions = starts[row_of_token] + np.arange(token_ends[-1]) - (token_ends - query_lens)[row_of_token]

        padding = np.asarray(batch.padding)[row_of_token] if any(batch.padding) else None
        tables, slots = _tables_and_slots(batch.block_tables, row_of_token, positions, bs, padding, self.scratch_slot)
        logits_index = (token_ends - 1)[np.asarray(batch.sample)]
        arrays = StepArrays(positions, seq_lens, tables, slots, logits_index, all_decode=bool((query_lens == 1).all()))
        if batch.window_tables is not None:
            arrays.window_tables, arrays.window_slots = _tables_and_slots(
                batch.window_tables, row_of_token, positions, bs, padding, self.window_scratch_slot)
        if batch.long_rope is not None:  # a long prompt's rows look up LongRoPE's long tables (models/rope.py)
            arrays.positions = positions + self.model.rotary.long_offset * np.asarray(batch.long_rope)[row_of_token]
        return arrays


def _tables_and_slots(block_tables: list[list[int]], row_of_token: np.ndarray, positions: np.ndarray, bs: int,
                      padding: np.ndarray | None, scratch_slot: int) -> tuple[np.ndarray, np.ndarray]:
    """Ragged block tables into one zero-padded array without a Python loop over rows (the batch's tables are copies
    the scheduler made: the KV manager's own lists grow for the next step while this one is prepared), and the slot
    each token's K/V goes to (``padding`` tokens': the scratch slot)."""
    lengths = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int64, count=int(lengths.sum()))
    tables = np.zeros((len(block_tables), int(lengths.max())), dtype=np.int64)
    tables[np.arange(tables.shape[1]) < lengths[:, None]] = flat
    slots = tables[row_of_token, positions // bs] * bs + positions % bs
    if padding is not None:
        slots[padding] = scratch_slot
    return tables, slots


def recorded_event() -> torch.cuda.Event:
    """A timing CUDA event recorded now on the current stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _reserved(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` (zeros) with its host memory taken now. A large zeroed host allocation is mapped lazily: each
    page would be taken when a block is first written, so a CPU engine's memory would climb for its first
    minutes of serving (benchmarks.soak saw ~330 MB of it) and a host without room would fail mid-serving
    instead of at start. Writing every page once makes the KV cache's memory what ``stats()`` says from the
    first request on. (Device memory is taken at allocation.)"""
    if cache.device.type == "cpu":
        cache.fill_(0.0)
    return cache
