"""CUDA graphs for decode steps: capture the model's forward once per bucketed batch size, then replay it.

A decode step of a large model launches hundreds of small kernels (about 15 per layer); launched one
by one from Python they cost more host time than the GPU spends reading the weights. A captured
graph launches them all at once. What changes from step to step lives in fixed device buffers that
the graph reads: token ids, positions, KV slots, block tables, context lengths, and the attention
backend's split length. A batch of n rows runs in the smallest captured size >= n; the rows past n
are padding that writes its KV to the scratch slot and attends to one key.

Only pure-decode steps use graphs (prefill shapes vary too much to be worth capturing); only
backends whose launches depend on nothing but the batch size can be captured
(``supports_cuda_graphs``).
"""

from __future__ import annotations

import numpy as np
import torch

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in BUCKETS if b < max_num_seqs]
    return sizes + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, model, backend, kv_caches, max_num_seqs: int, max_model_len: int, block_size: int,
                 scratch_slot: int, device: torch.device) -> None:
        self.model, self.backend = model, backend
        self.sizes = bucket_sizes(max_num_seqs)
        self.max_batch = self.sizes[-1]
        self.scratch_slot = scratch_slot
        n, max_blocks = self.max_batch, -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), scratch_slot, dtype=torch.long, device=device)
        self.block_tables = torch.zeros((n, max_blocks), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.metadata = {}
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: the smaller graphs fit in its memory pool
            meta = backend.static_decode_metadata(self.block_tables[:size], self.seq_lens[:size],
                                                  self.slot_mapping[:size], block_size, max_model_len)
            args = (self.input_ids[:size], self.positions[:size], kv_caches, meta)
            model(*args)  # compile every kernel before capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = model(*args)
            self.graphs[size], self.metadata[size] = graph, meta
        torch.cuda.synchronize(device)

    def fits(self, num_rows: int) -> bool:
        return num_rows <= self.max_batch

    def run(self, input_ids: torch.Tensor, positions: np.ndarray, slot_mapping: np.ndarray, block_tables: np.ndarray,
            seq_lens: np.ndarray) -> torch.Tensor:
        """Hidden states [num_rows, hidden] of one decode step (row i = token i). ``input_ids`` is already on the
        device: its placeholders may have been filled there (ModelRunner._input_ids)."""
        n = len(input_ids)
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(torch.from_numpy(positions), non_blocking=True)
        self.slot_mapping[:n].copy_(torch.from_numpy(slot_mapping), non_blocking=True)
        self.block_tables[:n, :block_tables.shape[1]].copy_(torch.from_numpy(block_tables), non_blocking=True)
        self.seq_lens[:n].copy_(torch.from_numpy(seq_lens), non_blocking=True)
        if size > n:  # padding rows: their KV goes to the scratch slot, they attend to one key
            self.slot_mapping[n:size].fill_(self.scratch_slot)
            self.seq_lens[n:size].fill_(1)
        self.backend.set_decode_context(self.metadata[size], int(seq_lens.max()))
        self.graphs[size].replay()
        return self.outputs[size][:n]
