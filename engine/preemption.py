"""What happens to a preempted request's KV: swapped to host blocks, or dropped to be recomputed.

The scheduler picks the victim (the running request ranked last, ``SchedulingPolicy.rank``) and takes its slot;
``Preemption.release`` decides, per victim, whether its KV is worth copying out (``preemption_mode``: ``auto``
swaps when that fits the host blocks and costs less time than recomputing, by the engine's measured rates) and
frees its device blocks. A swapped request's KV comes back into its new blocks when it is admitted again
(``swap_in``). The copies ride with the next batch that has rows (``take_copies``), outs before ins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from inflight.engine.block_pool import BlockPool, KVCacheManager

if TYPE_CHECKING:
    from inflight.engine.request import Request


class Preemption:
    def __init__(self, mode: str) -> None:
        self.mode = mode  # "auto", "swap" or "recompute"
        self.swap_pool: BlockPool | None = None  # host blocks for preempted requests' KV (set_swap_space)
        self._swap_out: list[tuple[int, int]] = []  # (device block, host block) copies the next batch makes first
        self._swap_in: list[tuple[int, int]] = []  # (host block, device block), after the outs
        # Host blocks a pending swap-in still has to read: a swap-out in the same step must not get them, since the
        # runner makes the outs first. Freed once the copies are handed out.
        self._host_blocks_read: list[int] = []
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        # Seconds to recompute n tokens / to copy n blocks out and back; the engine sets measured ones.
        self.recompute_seconds: Callable[[int], float] = lambda tokens: tokens * 1e-4
        self.swap_seconds: Callable[[int], float] = lambda blocks: blocks * 1e-5

    def set_swap_space(self, num_blocks: int) -> None:
        self.swap_pool = BlockPool(num_blocks) if num_blocks > 0 else None

    def use_measured_costs(self, block_bytes: int, swap_bytes_per_s: float,
                           per_prefill_token_s: Callable[[], float | None]) -> None:
        """Swap or recompute a victim by measured costs: its blocks copied out and back at the host-copy rate,
        against its tokens recomputed at the prefill cost per token (the TTFT predictor's, once it has one)."""
        if self.swap_pool is not None:
            self.swap_seconds = lambda blocks: 2 * blocks * block_bytes / swap_bytes_per_s

        def recompute_seconds(tokens: int) -> float:
            per_token = per_prefill_token_s()
            return tokens * (1e-4 if per_token is None else per_token)

        self.recompute_seconds = recompute_seconds

    def release(self, request: Request, kv: KVCacheManager, recompute: bool = False) -> None:
        """Free a preempted request's device blocks, its computed KV first copied to host blocks if it should be
        swapped (``request.swapped_blocks``), else (or with ``recompute``) dropped to be recomputed from position 0."""
        self.num_preemptions += 1
        request.metrics.num_preemptions += 1
        # only the blocks holding computed KV are worth copying
        table = kv.block_tables.get(request.request_id, [])[:kv.num_blocks_for(request.num_computed_tokens)]
        if not recompute and self._should_swap(request, len(table)):
            host = self.swap_pool.allocate(len(table))
            self._swap_out.extend(zip(table, host))
            self.num_swapped_out_blocks += len(table)
            request.swapped_blocks = host
        else:
            self.num_recomputed_tokens += request.num_computed_tokens
            request.num_computed_tokens = 0
            if request.has_prompt_work:
                request.restart_prompt_outputs()
        kv.free(request.request_id)

    def _should_swap(self, request: Request, num_blocks: int) -> bool:
        if (self.mode == "recompute" or self.swap_pool is None or not num_blocks
                or num_blocks > self.swap_pool.num_free):
            return False
        return self.mode == "swap" or self.swap_seconds(num_blocks) < self.recompute_seconds(request.num_computed_tokens)

    def swap_in(self, request: Request, table: list[int]) -> None:
        """An admitted swapped request: its KV comes back into the first blocks of its new ``table``."""
        host = request.swapped_blocks
        self._swap_in.extend(zip(host, table))
        self._host_blocks_read.extend(host)  # freed once the copy is handed out, not before
        self.num_swapped_in_blocks += len(host)
        request.swapped_blocks = None

    def forget(self, request: Request) -> None:
        """A request that ended while swapped out: its host copy is no longer needed."""
        if request.swapped_blocks is not None:
            self.swap_pool.free(request.swapped_blocks)
            request.swapped_blocks = None

    @property
    def has_copies(self) -> bool:
        return bool(self._swap_out or self._swap_in)

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies for the batch being built (outs, then ins); the host blocks the ins read are free after."""
        copies = self._swap_out, self._swap_in
        self._swap_out, self._swap_in = [], []
        self.swap_pool.free(self._host_blocks_read)
        self._host_blocks_read = []
        return copies
