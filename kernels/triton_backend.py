"""``TritonPagedAttention``: the Triton kernels of ``kernels.triton_kernels`` behind ``AttentionBackend``.

Per step, ``prepare`` splits the rows into decodes (one query token) and prefills (a prompt or a
chunk of one) and moves their small index tensors to the device once; every layer then launches at
most four kernels: store, decode (+ merge of its splits) and prefill.

Decode is split-KV (flash-decoding): when there are too few (row, kv head) pairs to fill the GPU,
each row's context is cut into splits that run in parallel and are merged by their log-sum-exps.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from inflight.kernels.backend import AttentionBackend, BatchLayout

PREFILL_BLOCK_M = 64  # query tokens per prefill program
PREFILL_BLOCK_N = 64  # keys per iteration of the prefill kernel
MIN_SPLIT_LEN = 256  # never split a context finer than this many keys
SPLIT_ALIGN = 128  # split lengths are multiples of this (the largest decode BLOCK_N)
PROGRAMS_PER_SM = 2  # how many decode programs per multiprocessor make a full GPU


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode kernel; ``tune_decode`` picks them per shape on a GPU."""

    block_n: int = 64  # keys per loop iteration
    num_warps: int = 4
    num_stages: int = 2


DECODE_CANDIDATES = [DecodeConfig(n, w, s) for n in (32, 64, 128) for w in (2, 4, 8) for s in (2, 3)
                     if not (n == 32 and w == 8)]
_tuned: dict[tuple, DecodeConfig] = {}  # per process: (group, head_dim, block_size, dtype) -> best config


def _triton():
    """Import the kernels; on a machine without CUDA they run in Triton's interpreter (tests, slowly).

    The interpreter is chosen when Triton is first imported, so it cannot be switched on later."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            raise RuntimeError("attention_backend 'triton' without CUDA needs TRITON_INTERPRET=1 set before "
                               "Triton is imported (it was imported already)")
        os.environ["TRITON_INTERPRET"] = "1"
    from inflight.kernels import triton_kernels

    return triton_kernels


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, 1 << max(0, n - 1).bit_length())


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]
    block_size: int
    block_tables: torch.Tensor  # [num_rows, max_blocks] int32
    seq_lens: torch.Tensor  # [num_rows] int32
    query_lens: torch.Tensor  # [num_rows] int32
    query_start: torch.Tensor  # [num_rows] int32, first token of each row in the flat batch
    num_decode: int
    decode_rows: torch.Tensor | None  # [num_decode] row ids
    decode_tokens: torch.Tensor | None  # [num_decode] their tokens in the flat batch
    decode_seq_lens: torch.Tensor | None
    decode_block_tables: torch.Tensor | None
    num_splits: int
    split_len: torch.Tensor  # [1] int32 on the device: keys per split (read by the kernels)
    num_prefill: int
    prefill_rows: torch.Tensor | None  # [num_prefill] row ids
    max_prefill_len: int


class TritonPagedAttention(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True  # a pure-decode step's launches depend only on the batch size

    def elementwise_ops(self):
        from inflight.kernels import triton_fused

        return triton_fused

    def __init__(self, num_sms: int | None = None, min_split_len: int = MIN_SPLIT_LEN,
                 decode_config: DecodeConfig | None = None) -> None:
        """``num_sms`` (default: the GPU's, else 8) and ``min_split_len`` steer how finely decode splits
        a context; tests lower them to exercise the merge on tiny inputs. ``decode_config`` fixes the
        decode kernel's launch parameters (else the tuned ones for the shape, else the defaults)."""
        self.kernels = _triton()
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 8
        self.num_sms = num_sms
        self.min_split_len = min_split_len
        self.decode_config = decode_config

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_blocks, num_kv_heads, block_size, head_dim)

    @staticmethod
    def cache_strides(cache: torch.Tensor) -> tuple[int, int, int]:
        """(block, kv head, slot) strides of a cache in this backend's layout; the kernels take any layout."""
        return cache.stride(0), cache.stride(1), cache.stride(2)

    def prepare(self, layout: BatchLayout) -> TritonAttentionMetadata:
        device = layout.slot_mapping.device
        query_lens, seq_lens = layout.query_lens, layout.seq_lens
        starts, total = [], 0
        for n in query_lens:
            starts.append(total)
            total += n
        decode = [r for r, n in enumerate(query_lens) if n == 1]
        prefill = [r for r, n in enumerate(query_lens) if n != 1]
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
        block_tables = layout.block_tables.to(torch.int32)
        meta = TritonAttentionMetadata(
            slot_mapping=layout.slot_mapping, block_size=layout.block_size, block_tables=block_tables,
            seq_lens=as_tensor(seq_lens), query_lens=as_tensor(query_lens), query_start=as_tensor(starts),
            num_decode=len(decode), decode_rows=None, decode_tokens=None, decode_seq_lens=None,
            decode_block_tables=None, num_splits=1, split_len=None, num_prefill=len(prefill), prefill_rows=None,
            max_prefill_len=max((query_lens[r] for r in prefill), default=0))
        if decode:
            meta.decode_rows = as_tensor(decode)
            meta.decode_tokens = as_tensor([starts[r] for r in decode])
            meta.decode_seq_lens = as_tensor([seq_lens[r] for r in decode])
            meta.decode_block_tables = block_tables.index_select(0, meta.decode_rows.long())
            max_seq_len = max(seq_lens[r] for r in decode)
            meta.num_splits = self._num_splits(max_seq_len, len(decode))
            meta.split_len = as_tensor([_split_len(max_seq_len, meta.num_splits)])
        if prefill:
            meta.prefill_rows = as_tensor(prefill)
        return meta

    def _num_splits(self, max_seq_len: int, num_decode: int) -> int:
        """Splits per row: enough (row, kv head, split) programs to fill the GPU, none shorter than
        ``min_split_len`` keys, and no split that would be empty for the longest row."""
        wanted = -(-self.num_sms * PROGRAMS_PER_SM // num_decode)
        splits = max(1, min(wanted, -(-max_seq_len // self.min_split_len)))
        return -(-max_seq_len // _split_len(max_seq_len, splits))

    # -- CUDA graphs: decode metadata over static buffers ------------------------------------------------
    def static_decode_metadata(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
                               block_size: int, max_model_len: int) -> TritonAttentionMetadata:
        """Metadata for a pure-decode batch that lives in fixed buffers (row i is token i), so the launches
        can be captured once and replayed: the split count is fixed for the batch size (sized for the
        longest context allowed); only ``split_len`` follows the step, see ``set_decode_context``."""
        num_rows, device = block_tables.shape[0], block_tables.device
        num_splits = self._num_splits(max_model_len, num_rows)
        rows = torch.arange(num_rows, dtype=torch.int32, device=device)
        return TritonAttentionMetadata(
            slot_mapping=slot_mapping, block_size=block_size, block_tables=block_tables, seq_lens=seq_lens,
            query_lens=torch.ones_like(seq_lens), query_start=rows, num_decode=num_rows, decode_rows=rows,
            decode_tokens=rows, decode_seq_lens=seq_lens, decode_block_tables=block_tables, num_splits=num_splits,
            split_len=torch.full((1,), _split_len(max_model_len, num_splits), dtype=torch.int32, device=device),
            num_prefill=0, prefill_rows=None, max_prefill_len=0)

    def set_decode_context(self, metadata: TritonAttentionMetadata, max_seq_len: int) -> None:
        """Spread this step's longest context over the captured number of splits."""
        metadata.split_len.fill_(_split_len(max_seq_len, metadata.num_splits))

    # -- tuning ------------------------------------------------------------------------------------------
    def tune_decode(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                    dtype: torch.dtype) -> DecodeConfig:
        """On a GPU, time every candidate launch configuration of the decode kernel on a realistic batch
        (32 rows of 2,048 scattered context tokens) and keep the fastest, once per process and shape."""
        key = (num_heads // num_kv_heads, head_dim, block_size, dtype)
        if self.decode_config is not None or not torch.cuda.is_available():
            return self.decode_config or DecodeConfig()
        if key not in _tuned:
            from triton.testing import do_bench

            batch, context = 32, 2048
            blocks = context // block_size
            tables = torch.randperm(batch * blocks, device="cuda").view(batch, blocks)
            shape = self.kv_cache_shape(batch * blocks, block_size, num_kv_heads, head_dim)
            k_cache = torch.randn(shape, dtype=dtype, device="cuda")
            v_cache = torch.randn(shape, dtype=dtype, device="cuda")
            meta = self.prepare(BatchLayout([1] * batch, [context] * batch, tables, tables[:, 0] * block_size,
                                            block_size))
            query = torch.randn(batch, num_heads, head_dim, dtype=dtype, device="cuda")
            timings = {}
            for config in DECODE_CANDIDATES:
                self.decode_config = config
                timings[config] = do_bench(lambda: self.forward(query, None, None, k_cache, v_cache, meta,
                                                                head_dim ** -0.5))
            self.decode_config = None
            _tuned[key] = min(timings, key=timings.get)
        return _tuned[key]

    def _decode_config(self, group: int, head_dim: int, block_size: int, dtype: torch.dtype) -> DecodeConfig:
        return self.decode_config or _tuned.get((group, head_dim, block_size, dtype)) or DecodeConfig()

    def store_kv(self, key, value, k_cache, v_cache, metadata: TritonAttentionMetadata) -> None:
        num_tokens, num_kv_heads, head_dim = key.shape
        _check_last_dim(key, value, k_cache, v_cache)
        self.kernels.store_kv_kernel[(num_tokens,)](
            key, value, k_cache, v_cache, metadata.slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            *self.cache_strides(k_cache),
            metadata.block_size, num_kv_heads, head_dim,
            HEADS_PAD=_pow2(num_kv_heads), DIM_PAD=_pow2(head_dim))

    def forward(self, query, key, value, k_cache, v_cache, metadata: TritonAttentionMetadata,
                scale: float, out: torch.Tensor | None = None, *, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """``out``: where to write (tests hand in a poisoned buffer); a fresh tensor by default. No window or
        soft-capping (``get_attention_backend`` picks another backend for a model with them)."""
        if window is not None or softcap is not None:
            raise ValueError("attention_backend 'triton' has no sliding-window or soft-capped attention")
        _check_last_dim(query, k_cache)
        if query.dtype == torch.bfloat16 and query.device.type == "cpu":
            # numpy has no bfloat16, and the interpreter's tl.dot reads bf16 bits as garbage.
            raise ValueError("attention_backend 'triton' on the CPU (Triton's interpreter) cannot run bfloat16; "
                             "use dtype float32 or float16, or the torch backend")
        num_tokens, num_heads, head_dim = query.shape
        num_kv_heads = k_cache.shape[1]
        group = num_heads // num_kv_heads
        if out is None:
            out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
        qk_scale = scale * self.kernels.LOG2E
        precision = "ieee" if query.dtype == torch.float32 else None
        dim_pad = _pow2(head_dim, 16)
        if metadata.num_decode:
            self._decode(query, k_cache, v_cache, out, metadata, qk_scale, group, dim_pad, precision)
        if metadata.num_prefill:
            grid = (metadata.num_prefill, num_heads, -(-metadata.max_prefill_len // PREFILL_BLOCK_M))
            self.kernels.prefill_attention_kernel[grid](
                query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, metadata.query_start,
                metadata.query_lens, metadata.prefill_rows, out,
                query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), metadata.block_tables.stride(0),
                qk_scale, metadata.block_size, head_dim,
                GROUP=group, DIM_PAD=dim_pad, BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=PREFILL_BLOCK_N, PRECISION=precision)
        return out

    def _decode(self, query, k_cache, v_cache, out, meta: TritonAttentionMetadata, qk_scale, group, dim_pad,
                precision) -> None:
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = k_cache.shape[1]
        config = self._decode_config(group, head_dim, meta.block_size, query.dtype)
        one_split = meta.num_splits == 1
        if one_split:  # the kernel writes ``out`` directly; the partial buffers are not touched
            partial_out = partial_lse = out
            partial_strides = (0, 0, 0, 0, 0)
        else:
            partial_out = torch.empty((meta.num_decode, num_heads, meta.num_splits, head_dim), dtype=torch.float32,
                                      device=query.device)
            partial_lse = torch.empty((meta.num_decode, num_heads, meta.num_splits), dtype=torch.float32,
                                      device=query.device)
            partial_strides = (partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
                               partial_lse.stride(0), partial_lse.stride(1))
        self.kernels.decode_attention_kernel[(meta.num_decode, num_kv_heads, meta.num_splits)](
            query, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, meta.decode_tokens,
            out, partial_out, partial_lse,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.decode_block_tables.stride(0),
            *partial_strides,
            qk_scale, meta.block_size, head_dim, meta.split_len,
            GROUP=group, GROUP_PAD=_pow2(group, 16), DIM_PAD=dim_pad, BLOCK_N=config.block_n,
            ONE_SPLIT=one_split, PRECISION=precision, num_warps=config.num_warps, num_stages=config.num_stages)
        if not one_split:
            self.kernels.merge_splits_kernel[(meta.num_decode, num_heads)](
                partial_out, partial_lse, meta.decode_seq_lens, meta.decode_tokens, out,
                *partial_strides, out.stride(0), out.stride(1),
                head_dim, meta.split_len,
                SPLITS_PAD=_pow2(meta.num_splits), DIM_PAD=dim_pad)


def _split_len(max_seq_len: int, num_splits: int) -> int:
    """Keys per split so that ``num_splits`` splits cover ``max_seq_len``, rounded up to ``SPLIT_ALIGN``."""
    per_split = -(-max_seq_len // num_splits)
    return -(-per_split // SPLIT_ALIGN) * SPLIT_ALIGN


def _check_last_dim(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"Triton attention needs the last (head_dim) dimension contiguous, got strides {t.stride()}")
