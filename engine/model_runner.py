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
from inflight.engine.models.cpu_decode import FusedDecode
from inflight.engine.models.cpu_packing import pack_linear_weights
from inflight.engine.models.llama import CausalLM
from inflight.engine.models.loader import build_model
from inflight.engine.models.source import ModelSource
from inflight.engine.sampler import Sampler, SamplingBatch, TokenLogprobs
from inflight.engine.structured_output import GrammarCompiler
from inflight.engine.scheduler_output import PrefillBatch, PromptRow, SchedulerOutput
from inflight.kernels import BatchLayout, get_attention_backend
from inflight.kernels.dense_prefill import DensePrefillMetadata

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 1 << 30
# Prompt logprobs need logits for every prompt position: they are computed this many bytes of
# [rows, vocab] float32 at a time, so a long prompt never holds tokens x vocab logits at once.
PROMPT_LOGITS_CHUNK_BYTES = 1 << 26


@dataclass
class StepArrays:
    """One step's inputs as host arrays, before they go to the device (eagerly, or into graph buffers)."""

    positions: np.ndarray  # [num_tokens]
    seq_lens: np.ndarray  # [num_rows]
    tables: np.ndarray  # [num_rows, max_blocks]
    slots: np.ndarray  # [num_tokens]
    logits_index: np.ndarray  # [num_sampling_rows]: the token whose hidden state each sampling row reads
    all_decode: bool


@dataclass
class PromptOutput:
    """What one prompt chunk handed back (``PromptRow``): the logprob of each prompt token it predicts, in
    order, and the sum over its positions of the final-norm hidden state."""

    logprobs: list[TokenLogprobs] | None
    pooled_sum: torch.Tensor | None  # [hidden] float32 on the host


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


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    return _resolve_dtype(name, checkpoint_dtype, device)[0]


def _resolve_dtype(name: str, checkpoint_dtype: str | None, device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype to run in, and why (logged at start)."""
    if name != "auto":
        return getattr(torch, name), "asked for"
    if device.type != "cpu":  # on a GPU, the checkpoint's half precision
        half = checkpoint_dtype if checkpoint_dtype in ("float16", "bfloat16") else "bfloat16"
        return getattr(torch, half), f"auto: the checkpoint's {checkpoint_dtype or 'unstated'} dtype on a GPU"
    # On a CPU, bfloat16 where the CPU has bfloat16 units (AVX-512 BF16, AMX) and our kernels run on them
    # (~1.7x float32's throughput), for a checkpoint stored in half precision; float32 elsewhere, where bfloat16
    # would be emulated. Under the CPU kernels bfloat16 layers keep a float32 residual stream
    # (CausalLM.residual_dtype): with transformers' bf16 stream the real model's logits moved by ~0.15 and, asked
    # for France's capital, it answered "L'Étoile, ..." at a near-tie where float32 says Paris (docs/benchmarks.md).
    from inflight.kernels import cpu_kernels

    hardware = cpu_kernels.bf16_hardware()
    if checkpoint_dtype not in ("bfloat16", "float16"):
        return torch.float32, f"auto: the checkpoint's {checkpoint_dtype or 'unstated'} dtype on a CPU"
    if hardware is None:
        return torch.float32, "auto: this CPU has no bfloat16 units"
    if not cpu_kernels.bf16_dot_products():
        return torch.float32, f"auto: this CPU has {hardware}, but the CPU kernels were built without its dot products"
    return torch.bfloat16, f"auto: a {checkpoint_dtype} checkpoint, and this CPU has {hardware}"


@dataclass(frozen=True)
class SharedBudget:
    """What another model on the same device takes from the KV budget (a draft model: engine.speculative.draft):
    its weights, and its KV per token (its cache holds as many tokens as this one's)."""

    weight_bytes: int
    kv_bytes_per_token: int


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int,
                 shared: SharedBudget | None = None) -> None:
        self.config = config
        self.shared = shared
        self.device = resolve_device(config.device)
        self.dtype, why = _resolve_dtype(config.dtype, source.config.torch_dtype, self.device)
        logger.info("running in %s (%s)", str(self.dtype).removeprefix("torch."), why)
        self._threads = None  # (thread, count) the last step ran on, where steps may change the count
        if self.device.type == "cpu":
            if config.num_threads is not None:
                torch.set_num_threads(config.num_threads)
            if config.one_thread_max_tokens > 0:
                self._all = torch.get_num_threads()
                self._threads = (None, self._all)
        self.backend = get_attention_backend(config.attention_backend, self.device, self.dtype)
        multiple = self.backend.block_size_multiple
        if config.block_size % multiple:
            # e.g. flash-attn's paged KV wants blocks of 256 tokens; the engine reads the adjusted config back
            self.config = config = dataclasses.replace(config, block_size=-(-config.block_size // multiple) * multiple)
        self.block_size = config.block_size
        self.model: CausalLM = build_model(source, self.backend, max_model_len, self.dtype, self.device,
                                           config.load_format)
        if self.device.type == "cpu":
            pack_linear_weights(self.model)  # faster decode-sized matmuls (see cpu_packing.py)
            if self.dtype == torch.bfloat16 and self.backend.elementwise_ops() is not None:
                self.model.residual_dtype = torch.float32  # the CPU kernels' norm keeps it (CausalLM.residual_dtype)
                self.model.fused_decode = FusedDecode.for_model(self.model, self.backend)  # (None: layer by layer)
        self.model_config = source.config
        self.num_kv_blocks = self._count_kv_blocks(max_model_len)
        shape = self.backend.kv_cache_shape(self.num_kv_blocks + 1, self.block_size, source.config.num_kv_heads,
                                            source.config.head_dim)
        # The extra last block is scratch: static-mode padding rows write there and nobody reads it.
        self.kv_caches = [(_reserved(torch.zeros(shape, dtype=self.dtype, device=self.device)),
                           _reserved(torch.zeros(shape, dtype=self.dtype, device=self.device)))
                          for _ in range(source.config.num_layers)]
        self.scratch_slot = self.num_kv_blocks * self.block_size
        vocab_size = source.config.vocab_size
        self.sampler = Sampler(config.seed, lambda: GrammarCompiler(source.tokenizer, vocab_size, source.eos_token_ids))
        # Host memory for preempted requests' KV (swapping), in the device cache's layout, block for block.
        self.num_swap_blocks = config.swap_space_bytes // self.kv_bytes_per_block
        host_shape = self.backend.kv_cache_shape(self.num_swap_blocks, self.block_size, source.config.num_kv_heads,
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
                tune(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.block_size, self.dtype)
            if not config.enforce_eager and getattr(self.backend, "supports_cuda_graphs", False):
                self.graphs = DecodeGraphs(self.model, self.backend, self.kv_caches, config.max_num_seqs,
                                           max_model_len, self.block_size, self.scratch_slot, self.device)

    @property
    def kv_bytes_per_block(self) -> int:
        cfg = self.model_config
        return 2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize

    def _count_kv_blocks(self, max_model_len: int) -> int:
        """Blocks for the KV budget; with a ``SharedBudget`` the budget holds a block of the other model's KV for
        every block of ours, and on CUDA its weights too (an explicit ``num_kv_blocks`` is taken as it is)."""
        config = self.config
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        per_block, shared = self.kv_bytes_per_block, self.shared
        if shared is not None:
            per_block += shared.kv_bytes_per_token * self.block_size
        if config.kv_cache_memory_bytes is not None:
            budget = config.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            # What a full step needs on top of the weights is measured, not guessed: run one.
            activations = self._peak_step_bytes(max_model_len)
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free  # the weights, and whatever else lives on the device
            budget = int(total * config.gpu_memory_utilization) - used - activations
            if shared is not None:  # loaded after this count: its weights come out of the same budget
                budget -= shared.weight_bytes
        else:
            # Enough for every slot at full length, capped so a laptop is not swamped.
            wanted = config.max_num_seqs * -(-max_model_len // self.block_size) * per_block
            budget = min(wanted, CPU_DEFAULT_KV_BYTES)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_bytes: {budget} bytes is less than one KV block "
                             f"({per_block} bytes)")
        return int(num_blocks)

    @torch.inference_mode()
    def _peak_step_bytes(self, max_model_len: int) -> int:
        """Peak device memory of the largest step (one row of ``max_num_batched_tokens`` tokens, logits for
        ``max_num_seqs`` rows) run against a throwaway cache just big enough for it."""
        cfg, bs = self.model_config, self.block_size
        num_tokens = min(self.config.max_num_batched_tokens, max_model_len)
        num_blocks = -(-num_tokens // bs)
        shape = self.backend.kv_cache_shape(num_blocks + 1, bs, cfg.num_kv_heads, cfg.head_dim)
        caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                   torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(cfg.num_layers)]
        layout = BatchLayout(query_lens=[num_tokens], seq_lens=[num_tokens],
                             block_tables=torch.arange(num_blocks, device=self.device)[None],
                             slot_mapping=torch.arange(num_tokens, device=self.device), block_size=bs)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        hidden = self.model(torch.zeros(num_tokens, dtype=torch.long, device=self.device),
                            torch.arange(num_tokens, device=self.device), caches, self.backend.prepare(layout))
        logits = self.model.compute_logits(hidden[:min(num_tokens, self.config.max_num_seqs)]).float()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del caches, hidden, logits
        torch.cuda.empty_cache()
        return int(peak)

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
    def launch(self, batch: SchedulerOutput, sampling: SamplingBatch) -> LaunchedStep:
        """Queue one step's device work. Tokens come back at once (on the host) unless every sampling row is
        plain greedy: then they stay on the device until ``collect``, and the next launch may come first."""
        started = time.perf_counter()
        cuda = self.device.type == "cuda"
        start_event = recorded_event() if cuda else None
        if batch.swap_out or batch.swap_in:
            self.copy_blocks(batch.swap_out, batch.swap_in)
        if batch.ended_ids:
            self.sampler.forget(batch.ended_ids)
        if self._threads is not None:
            self._use_threads(len(batch.input_token_ids))
        arrays = self._prepare(batch)
        logits_index = torch.from_numpy(arrays.logits_index).to(self.device, non_blocking=True)
        input_ids = self._input_ids(batch)
        if self.graphs is not None and arrays.all_decode and self.graphs.fits(batch.num_rows):
            hidden = self.graphs.run(input_ids, arrays.positions, arrays.slots, arrays.tables, arrays.seq_lens)
        else:
            to = lambda a: torch.from_numpy(a).to(self.device)  # noqa: E731
            layout = BatchLayout(query_lens=batch.query_lens, seq_lens=arrays.seq_lens.tolist(),
                                 block_tables=to(arrays.tables), slot_mapping=to(arrays.slots),
                                 block_size=self.block_size)
            hidden = self.model(input_ids, to(arrays.positions), self.kv_caches, self.backend.prepare(layout))
        sampled: list[int | None] = [None] * batch.num_rows
        logprobs: list[TokenLogprobs | None] = [None] * batch.num_rows
        sample_rows = [i for i, s in enumerate(batch.sample) if s]
        output = RunnerOutput(sampled, logprobs)
        step = LaunchedStep(output, batch.request_ids, sample_rows, started=start_event)
        if sample_rows and batch.spec_token_ids:
            self._verify(hidden, batch, sample_rows, sampling, output)
        elif sample_rows:
            logits = self.model.compute_logits(hidden[logits_index])
            tokens = self.sampler.greedy_tokens(logits, sampling)
            if tokens is not None:  # left on the device: collect() brings them to the host
                step.tokens = tokens
                step.host_tokens = tokens.to("cpu", non_blocking=True) if cuda else tokens
            else:
                token_ids, token_logprobs = self.sampler(logits, sampling)
                for row, token_id, lp in zip(sample_rows, token_ids, token_logprobs):
                    sampled[row] = token_id
                    logprobs[row] = lp
        if batch.prompt_rows:
            output.prompt_outputs = self._prompt_outputs(hidden, batch.input_token_ids, batch.query_lens,
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
        if not rows:
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
        query_lens = [len(ids) for ids in batch.token_ids]
        flat = list(itertools.chain.from_iterable(batch.token_ids))
        input_ids = torch.tensor(flat, dtype=torch.long, device=self.device)
        positions = torch.from_numpy(np.concatenate([np.arange(n) for n in query_lens])).to(self.device)
        hidden = self.model(input_ids, positions, None, DensePrefillMetadata(query_lens))
        outputs = self._prompt_outputs(hidden, flat, query_lens, dict(enumerate(batch.rows)))
        return [outputs[row] for row in range(len(query_lens))]

    def _prompt_outputs(self, hidden: torch.Tensor, input_token_ids: list[int], query_lens: list[int],
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
                pooled[row] = self.model.final_hidden(hidden[start:end]).float().sum(dim=0).cpu()
            if work.num_top_logprobs is not None:
                row_targets = input_token_ids[start + 1:end]
                if work.next_token_id is not None:
                    row_targets = [*row_targets, work.next_token_id]
                positions.extend(range(start, start + len(row_targets)))
                targets.extend(row_targets)
                counts[row] = len(row_targets)
        logprobs = self._token_logprobs(hidden, positions, targets,
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

    def _token_logprobs(self, hidden: torch.Tensor, positions: list[int], targets: list[int],
                        num_top: int) -> list[TokenLogprobs]:
        """For each position: (target, its logprob, its rank) and the ``num_top`` best (token, logprob), computed
        in chunks of rows so that [rows, vocab] logits stay within ``PROMPT_LOGITS_CHUNK_BYTES``."""
        chunk = max(1, PROMPT_LOGITS_CHUNK_BYTES // (4 * self.model_config.vocab_size))
        result: list[TokenLogprobs] = []
        for first in range(0, len(positions), chunk):
            index = torch.tensor(positions[first:first + chunk], device=self.device)
            wanted = torch.tensor(targets[first:first + chunk], device=self.device)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[index]), dim=-1)  # [rows, vocab]
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

    def _prepare(self, batch: SchedulerOutput) -> StepArrays:
        bs = self.block_size
        query_lens = np.asarray(batch.query_lens, dtype=np.int64)
        starts = np.asarray(batch.start_positions, dtype=np.int64)
        seq_lens = starts + query_lens
        token_ends = np.cumsum(query_lens)
        row_of_token = np.repeat(np.arange(batch.num_rows), query_lens)
        # position of each token = its row's start + its offset inside the row
        positions = starts[row_of_token] + np.arange(token_ends[-1]) - (token_ends - query_lens)[row_of_token]

        # Ragged block tables into one zero-padded array without a Python loop over rows (the batch's tables are
        # copies the scheduler made: the KV manager's own lists grow for the next step while this one is prepared).
        block_tables = batch.block_tables
        lengths = np.fromiter(map(len, block_tables), dtype=np.int64, count=batch.num_rows)
        flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int64, count=int(lengths.sum()))
        tables = np.zeros((batch.num_rows, int(lengths.max())), dtype=np.int64)
        tables[np.arange(tables.shape[1]) < lengths[:, None]] = flat
        slots = tables[row_of_token, positions // bs] * bs + positions % bs
        if any(batch.padding):
            slots[np.asarray(batch.padding)[row_of_token]] = self.scratch_slot

        logits_index = (token_ends - 1)[np.asarray(batch.sample)]
        return StepArrays(positions, seq_lens, tables, slots, logits_index, all_decode=bool((query_lens == 1).all()))


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
