"""How many KV blocks a model runner gets: the budget (what the engine arguments give, on CUDA what is free after the
weights and a measured peak step), shared with a draft model when there is one, in blocks; where the model's
sliding-window layers keep their KV apart (block_pool.py), split between their window caches and the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from inflight.kernels import BatchLayout

if TYPE_CHECKING:
    from inflight.engine.model_runner import ModelRunner

CPU_DEFAULT_KV_BYTES = 1 << 30


@dataclass(frozen=True)
class SharedBudget:
    """What another model on the same device takes from the KV budget (a draft model: engine.speculative.draft):
    its weights, and its KV per token (its cache holds as many tokens as this one's)."""

    weight_bytes: int
    kv_bytes_per_token: int


def count_kv_blocks(runner: ModelRunner, max_model_len: int) -> tuple[int, int]:
    """(blocks of the block tables, blocks of the window caches) for the KV budget. With a ``SharedBudget`` the
    budget holds a block of the other model's KV for every block of ours, and on CUDA its weights too (an explicit
    ``num_kv_blocks`` is taken as it is). Window caches: the budget is split so that as many requests of
    ``max_model_len`` fit in both kinds of layer (each holds its whole length in the others' caches, one window in
    the window caches) and a step's new tokens fit too, never more than every slot's window needs
    (``window_blocks_needed``): more tokens fit than with every layer's KV kept whole."""
    config = runner.config
    num_window_layers = len(runner.window_layers)
    need = window_blocks_needed(config, runner.model_config.sliding_window, runner.block_size) if num_window_layers else 0
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks, min(need, config.num_kv_blocks)
    per_block, shared = runner.kv_layer_block_bytes * runner.model_config.num_layers, runner.shared
    if shared is not None:
        per_block += shared.kv_bytes_per_token * runner.block_size
    if config.kv_cache_memory_bytes is not None:
        budget = config.kv_cache_memory_bytes
    elif runner.device.type == "cuda":
        # What a full step needs on top of the weights is measured, not guessed: run one.
        activations = peak_step_bytes(runner, max_model_len)
        free, total = torch.cuda.mem_get_info(runner.device)
        used = total - free  # the weights, and whatever else lives on the device
        budget = int(total * config.gpu_memory_utilization) - used - activations
        if shared is not None:  # loaded after this count: its weights come out of the same budget
            budget -= shared.weight_bytes
    else:
        # Enough for every slot at full length, capped so a laptop is not swamped.
        wanted = config.max_num_seqs * -(-max_model_len // runner.block_size) * per_block
        budget = min(wanted, CPU_DEFAULT_KV_BYTES)
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory_bytes: {budget} bytes is less than one KV block "
                         f"({per_block} bytes)")
    if not num_window_layers:
        return int(num_blocks), 0
    bs, window_block = runner.block_size, num_window_layers * runner.kv_layer_block_bytes  # (every window layer's)
    per_block -= window_block
    whole = -(-max_model_len // bs)  # a longest request's blocks in the block tables
    windowed = min(whole, -(-(runner.model_config.sliding_window - 1) // bs) + 2)  # and in the window caches
    step = -(-config.max_num_batched_tokens // bs)
    requests = max(0, budget - step * window_block) // (whole * per_block + windowed * window_block)
    num_window_blocks = max(1, min(need, requests * windowed + step, budget // window_block))
    if per_block == 0:  # every layer slides: the block tables hold no memory, only the count of a request's tokens
        return config.max_num_seqs * whole, int(num_window_blocks)
    return int((budget - num_window_blocks * window_block) // per_block), int(num_window_blocks)


def window_blocks_needed(config, window: int, block_size: int) -> int:
    """Window blocks the engine can hold at once: each slot's window before a step (positions ``start - window + 1``
    to ``start - 1`` span at most ``ceil((window - 1) / block_size) + 1`` blocks) and the step's new tokens (at most
    ``max_num_batched_tokens``, plus a part-filled block a row)."""
    per_slot = -(-(window - 1) // block_size) + 1
    return config.max_num_seqs * (per_slot + 1) + -(-config.max_num_batched_tokens // block_size)


@torch.inference_mode()
def peak_step_bytes(runner: ModelRunner, max_model_len: int) -> int:
    """Peak device memory of the largest step (one row of ``max_num_batched_tokens`` tokens, logits for
    ``max_num_seqs`` rows) run against a throwaway cache just big enough for it."""
    cfg, bs = runner.model_config, runner.block_size
    num_tokens = min(runner.config.max_num_batched_tokens, max_model_len)
    num_blocks = -(-num_tokens // bs)
    shape = runner.backend.kv_cache_shape(num_blocks + 1, bs, runner.kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape, dtype=runner.dtype, device=runner.device),
               torch.zeros(shape, dtype=runner.dtype, device=runner.device)) for _ in range(cfg.num_layers)]
    layout = BatchLayout(query_lens=[num_tokens], seq_lens=[num_tokens],
                         block_tables=torch.arange(num_blocks, device=runner.device)[None],
                         slot_mapping=torch.arange(num_tokens, device=runner.device), block_size=bs)
    torch.cuda.synchronize(runner.device)
    torch.cuda.reset_peak_memory_stats(runner.device)
    before = torch.cuda.memory_allocated(runner.device)
    hidden = runner.model(torch.zeros(num_tokens, dtype=torch.long, device=runner.device),
                          torch.arange(num_tokens, device=runner.device), caches, runner.backend.prepare(layout))
    logits = runner.model.compute_logits(hidden[:min(num_tokens, runner.config.max_num_seqs)])
    torch.cuda.synchronize(runner.device)
    peak = torch.cuda.max_memory_allocated(runner.device) - before
    del caches, hidden, logits
    torch.cuda.empty_cache()
    return int(peak)
