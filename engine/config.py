"""Engine configuration: one frozen dataclass, checked once when it is built."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from inflight.engine.models.packaged import DEFAULT_MODEL
from inflight.engine.speculative.config import SpeculativeConfig

BatchingMode = Literal["continuous", "static"]
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")
QUANTIZATIONS = ("auto", "none", "fp8")
SCHEDULING_POLICIES = ("fcfs", "priority", "fair")
ADMISSION_MODES = ("max_utilization", "guaranteed_no_evict")
PREEMPTION_MODES = ("auto", "recompute", "swap")
TENSOR_PARALLEL_BACKENDS = ("auto", "shm", "gloo", "nccl")
ATTENTION_BACKENDS = ("auto", "flash_attn", "triton", "cpu", "torch")  # kernels.backend.BACKENDS


@dataclass(frozen=True)
class EngineConfig:
    """Every knob of the engine. Build it with ``EngineConfig.from_kwargs`` to get checked values.

    KV memory is either ``num_kv_blocks`` blocks of ``block_size`` tokens, or as many blocks as fit
    in ``kv_cache_memory_bytes``, or (on CUDA) ``gpu_memory_utilization`` of the device.
    """

    model: str = DEFAULT_MODEL
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's own limit
    batching: BatchingMode = "continuous"
    # Who goes first. fcfs: arrival order. priority: lower ``priority`` value first (vLLM's convention:
    # 0 beats 10), then arrival. Either way a request that has waited max_queue_wait_s since it arrived goes
    # ahead of everything younger, preempting a running request that arrived after it if it must (None: no aging).
    # fair: tenants (SamplingParams.tenant) take turns by the service each has had (virtual token counters):
    # a tenant's flood does not push another tenant's requests to the back; arrival order within a tenant.
    scheduling_policy: str = "fcfs"
    max_queue_wait_s: float | None = 30.0
    # max_utilization: admit while blocks for the next chunk exist, preempt on shortage (vLLM).
    # guaranteed_no_evict: admit only when prompt + max_tokens fits, so nothing is ever preempted (TensorRT-LLM).
    admission_mode: str = "max_utilization"
    # max_utilization admits a request only if, beside its whole prompt and this many tokens of its output, every
    # running request keeps blocks for the rest of its prompt and this many more tokens: admitting past that
    # only lets decode growth preempt someone (and recompute it) a few steps later. 0: admit while the next
    # chunk fits, as vLLM does.
    kv_headroom_tokens: int = 16
    enable_prefix_caching: bool = True  # share full KV blocks between requests by content hash
    # A preempted request's KV is recomputed later, or swapped to host memory (up to swap_space_bytes) and
    # copied back. auto: per victim, whichever costs less time (tokens to recompute vs bytes to copy).
    preemption_mode: str = "auto"
    swap_space_bytes: int = 0
    attention_backend: str = "auto"  # auto: flash-attn, then Triton, on CUDA; the compiled CPU kernels on a CPU
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps (debugging, or to save their memory)
    # Schedule step N+1 while the device runs step N, its decode rows fed the tokens step N samples (they never
    # visit the host first); step N's outputs are processed meanwhile too. None (auto): on for continuous
    # batching on CUDA. On a CPU the forward shares the cores with the host work, so it is off there unless asked.
    async_scheduling: bool | None = None
    # Decode steps over an unchanged running set from a batch kept across steps (engine/persistent_batch.py),
    # continuous batching only. False: the general path schedules every step (for comparison; same results).
    persistent_batch: bool = True
    load_format: str = "auto"  # "dummy": random weights of the checkpoint's shape (benchmarks; no weight files read)
    # "auto": a GGUF file's Q4_0/Q4_1/Q4_K/Q8_0 weights stay quantized on the CPU (int8 kernels, 6-10 bits a weight
    # read per step instead of 16); other types, and every weight on a GPU, are dequantized to dtype. "none":
    # everything dequantized (the exact model transformers loads from the file). "fp8" (GPU): the layers' linear
    # weights quantized at load to float8 e4m3, a scale per output row (half of bf16's bytes; Triton kernel).
    quantization: str = "auto"
    # Ranks the model is cut over (engine/parallel/): rank 0 is the engine's own process, the others worker processes
    # started with it, each holding its part of every layer and its own KV cache (for its heads). On a CPU each rank
    # gets a contiguous part of the CPUs the engine may use. The sizes a model allows: at most its KV heads, or a
    # multiple of them that divides each KV head's query heads (a wrong one is refused, naming those that work).
    tensor_parallel_size: int = 1
    # Who starts the other ranks: "local", the engine (spawned processes); "external", the serving layer (a Ray
    # replica's worker actors in its placement group, serve_app/rank_actors.py), which picks the port on this host
    # where rank 0 waits for them (tensor_parallel_port). Not for users to set: serve configs set the size only.
    tensor_parallel_workers: str = "local"
    tensor_parallel_port: int | None = None
    # What carries the ranks' partial sums: "auto" (shared memory between CPU ranks, NCCL between GPUs), or "shm",
    # "gloo" (torch.distributed on CPU ranks: ~1 ms an all-reduce here, for comparison), "nccl".
    tensor_parallel_backend: str = "auto"
    num_threads: int | None = None  # torch intra-op threads on the CPU (per rank); None leaves torch's default
    # CPU, more than one thread: a step of at most this many tokens (a decode of a few rows) runs on one thread.
    # Such a step gains little from a second thread, and where the serving processes share the cores (a server's
    # router and replica handle every token a step makes) its other threads wait for a core at every op: one
    # served stream's time per token went from 3.4-3.5 ms on one pinned thread to 4.7 ms on two. 0: every step
    # runs on all of them.
    one_thread_max_tokens: int = 0
    # Requests that generate nothing (prompt scoring with max_tokens=0, embeddings) take the prefill lane
    # (engine/prefill_lane.py): static batches of whole prompts, formed in arrival order up to these limits
    # (a longer prompt runs alone), one per engine step, computed without the KV cache. Off: they go
    # through the scheduler and the paged cache like any prefill ("mixed").
    prefill_lane: bool = True
    max_prefill_batch_tokens: int = 2048
    max_prefill_batch_size: int = 32
    # Speculative decoding (engine/speculative/): None, or its settings (a dict or a SpeculativeConfig), e.g.
    # {"method": "ngram", "num_speculative_tokens": 4}. Continuous batching with the synchronous loop only.
    speculative_config: Any = None

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if "speculative_config" in kwargs:
            kwargs["speculative_config"] = SpeculativeConfig.from_value(kwargs["speculative_config"])
        config = cls(**kwargs)
        config.validate()
        return config

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}, got {getattr(self, name)!r}")

        if not isinstance(self.model, str) or not self.model:
            raise bad("model", "must be a packaged model's name, a checkpoint path, or 'demo-tiny'")
        if self.device not in DEVICES:
            raise bad("device", f"must be one of {DEVICES}")
        if self.dtype not in DTYPES:
            raise bad("dtype", f"must be one of {DTYPES}")
        if not isinstance(self.block_size, int) or self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise bad("block_size", "must be a power of two")
        for name in ("num_kv_blocks", "kv_cache_memory_bytes", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise bad(name, "must be a positive integer or None")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad("gpu_memory_utilization", "must be in (0, 1]")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise bad("max_num_seqs", "must be an integer >= 1")
        if not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < self.max_num_seqs:
            raise bad("max_num_batched_tokens", f"must be an integer >= max_num_seqs ({self.max_num_seqs})")
        if self.batching not in ("continuous", "static"):
            raise bad("batching", "must be 'continuous' or 'static'")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise bad("attention_backend", f"must be one of {ATTENTION_BACKENDS}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise bad("scheduling_policy", f"must be one of {SCHEDULING_POLICIES}")
        if self.max_queue_wait_s is not None and (not isinstance(self.max_queue_wait_s, (int, float))
                                                  or isinstance(self.max_queue_wait_s, bool)
                                                  or not self.max_queue_wait_s > 0):
            raise bad("max_queue_wait_s", "must be a number of seconds > 0, or None for no aging")
        if self.admission_mode not in ADMISSION_MODES:
            raise bad("admission_mode", f"must be one of {ADMISSION_MODES}")
        if not isinstance(self.kv_headroom_tokens, int) or isinstance(self.kv_headroom_tokens, bool) \
                or self.kv_headroom_tokens < 0:
            raise bad("kv_headroom_tokens", "must be an integer >= 0")
        if not isinstance(self.enable_prefix_caching, bool):
            raise bad("enable_prefix_caching", "must be true or false")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise bad("preemption_mode", f"must be one of {PREEMPTION_MODES}")
        if not isinstance(self.swap_space_bytes, int) or isinstance(self.swap_space_bytes, bool) \
                or self.swap_space_bytes < 0:
            raise bad("swap_space_bytes", "must be an integer >= 0")
        if self.preemption_mode == "swap" and self.swap_space_bytes == 0:
            raise bad("swap_space_bytes", "must be > 0 when preemption_mode is 'swap'")
        if not isinstance(self.enforce_eager, bool):
            raise bad("enforce_eager", "must be true or false")
        if not isinstance(self.persistent_batch, bool):
            raise bad("persistent_batch", "must be true or false")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise bad("async_scheduling", "must be true, false or None (auto)")
        if self.async_scheduling and self.batching == "static":
            raise bad("async_scheduling", "needs continuous batching (a static batch has nothing to schedule ahead)")
        if self.speculative_config is not None:
            if not isinstance(self.speculative_config, SpeculativeConfig):
                raise bad("speculative_config", "must be built by EngineConfig.from_kwargs (a dict of its settings)")
            if self.batching == "static":
                raise bad("batching", "must be 'continuous' with speculative_config (a static batch decodes in "
                                      "lockstep, one token per member)")
            if self.async_scheduling:
                raise bad("async_scheduling", "must be false or None with speculative_config (verification needs "
                                              "each step's tokens before the next is scheduled)")
        if self.load_format not in LOAD_FORMATS:
            raise bad("load_format", f"must be one of {LOAD_FORMATS}")
        if self.quantization not in QUANTIZATIONS:
            raise bad("quantization", f"must be one of {QUANTIZATIONS}")
        if not isinstance(self.tensor_parallel_size, int) or isinstance(self.tensor_parallel_size, bool) \
                or self.tensor_parallel_size < 1:
            raise bad("tensor_parallel_size", "must be an integer >= 1")
        if self.tensor_parallel_backend not in TENSOR_PARALLEL_BACKENDS:
            raise bad("tensor_parallel_backend", f"must be one of {TENSOR_PARALLEL_BACKENDS}")
        if self.tensor_parallel_workers not in ("local", "external"):
            raise bad("tensor_parallel_workers", "must be 'local' or 'external'")
        if self.tensor_parallel_workers == "external" and not (isinstance(self.tensor_parallel_port, int)
                                                               and 0 < self.tensor_parallel_port < 65536):
            raise bad("tensor_parallel_port", "must be a port number when tensor_parallel_workers is 'external'")
        if self.tensor_parallel_size > 1 and self.quantization == "fp8":
            raise bad("quantization", "cannot be 'fp8' with tensor_parallel_size > 1 yet (its weights are quantized "
                                      "whole at load)")
        if self.num_threads is not None and (not isinstance(self.num_threads, int) or self.num_threads < 1):
            raise bad("num_threads", "must be a positive integer or None")
        if not isinstance(self.one_thread_max_tokens, int) or isinstance(self.one_thread_max_tokens, bool) \
                or self.one_thread_max_tokens < 0:
            raise bad("one_thread_max_tokens", "must be a non-negative integer")
        if not isinstance(self.prefill_lane, bool):
            raise bad("prefill_lane", "must be true or false")
        for name in ("max_prefill_batch_tokens", "max_prefill_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(name, "must be an integer >= 1")
