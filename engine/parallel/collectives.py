"""What tensor-parallel ranks exchange inside a step: a sum (all-reduce), rank 0 gathering everyone's part, and rank
0's tensor sent to all (broadcast); and, through shared memory always, a minimum of an integer (sizing the KV cache to
the rank with least room) and the ranks' pids (liveness).

``ShmCollectives`` (CPU ranks on one node): every exchange is one round through shared memory. Each rank copies its
part into its slot and publishes the round's number; once every rank has published, each reads the slots it needs.
Slots alternate between two sets, so a rank that has seen everyone publish round n knows they have all finished
reading round n - 1's slots, and may overwrite them in round n + 1. A sum adds the parts in rank order on every rank,
in float32, rounded once, so every rank holds the same bits; an all-reduce round is one call of the CPU kernels
(``kernels/csrc/shm_reduce.h``), or the same in PyTorch where they are not built. gloo's TCP all-reduce took 1.0-1.7
ms here for 1-64 rows of the benchmark model (60 a step); one round here is a few copies.

``TorchCollectives``: the same operations on a ``torch.distributed`` process group (NCCL on GPUs; gloo works too),
built from a store without touching ``torch.distributed``'s global state (an offline ``LLM`` runs rank 0 in the
user's own process).
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Protocol

import torch
import torch.distributed as dist

from inflight.engine.parallel.shm import PeerLost, Region, Waiter, fence, process_alive
from inflight.kernels import cpu_kernels

CHUNK_BYTES = 4 << 20  # per rank and slot set: larger tensors go in rounds
JOIN_TIMEOUT_S = 600.0  # a rank that has not attached by then (loading a large checkpoint takes minutes) is lost
SPIN_NS = 1_000_000  # how long the C++ round spins for the other ranks before napping in Python
_STRIDE = 8  # words between two ranks' counters (a cache line each)


class Collectives(Protocol):
    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """``tensor`` becomes the sum of every rank's ``tensor`` (in place, same bits on every rank)."""

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``tensor`` (equal shapes), in rank order, on rank 0; None elsewhere."""

    def broadcast(self, tensor: torch.Tensor) -> None:
        """``tensor`` becomes rank 0's (in place)."""

    def close(self) -> None: ...


class ShmCollectives:
    """Collectives through one shared memory region: counters, the ranks' pids, and two sets of a slot per rank."""

    def __init__(self, region: Region, rank: int, size: int, chunk_bytes: int) -> None:
        self.region, self.rank, self.size, self.chunk_bytes = region, rank, size, chunk_bytes
        self._published = region.words(0, size * _STRIDE)
        self._flags = self._published[::_STRIDE]
        self._pids = region.words(size * _STRIDE * 8, size)
        data_offset = (size * _STRIDE + size) * 8
        data = torch.frombuffer(region.buf, dtype=torch.uint8, offset=data_offset, count=2 * size * chunk_bytes)
        self._slots = data.view(2, size, chunk_bytes)
        self._pids[rank] = os.getpid()
        self._round = 0
        self._waiter = Waiter(self.check_peers, max_nap_s=1e-3)
        self._join_deadline = time.monotonic() + JOIN_TIMEOUT_S
        self._watch = None

    @staticmethod
    def region_bytes(size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
        return (size * _STRIDE + size) * 8 + 2 * size * chunk_bytes

    @classmethod
    def create(cls, size: int, chunk_bytes: int = CHUNK_BYTES) -> ShmCollectives:
        return cls(Region.create(cls.region_bytes(size, chunk_bytes), "inflight-tp"), 0, size, chunk_bytes)

    @classmethod
    def attach(cls, name: str, rank: int, size: int, chunk_bytes: int = CHUNK_BYTES) -> ShmCollectives:
        return cls(Region.attach(name), rank, size, chunk_bytes)

    def watch(self, check) -> None:
        """Also call ``check`` (raising ``PeerLost``) while waiting: what this rank knows of the others' processes."""
        self._watch = check

    def check_peers(self) -> None:
        """``PeerLost`` if a rank has died, or has not joined within ``JOIN_TIMEOUT_S`` of this one."""
        if self._watch is not None:
            self._watch()
        self.check_pids()

    def check_pids(self) -> None:
        """``check_peers`` by the pids the ranks wrote here alone."""
        for rank, pid in enumerate(self._pids.tolist()):
            if rank == self.rank:
                continue
            if not pid and time.monotonic() > self._join_deadline:
                raise PeerLost(f"tensor parallel: rank {rank} has not joined in {JOIN_TIMEOUT_S:.0f} s")
            if pid and not process_alive(pid):
                raise PeerLost(f"tensor parallel: rank {rank} (pid {pid}) has died")

    def _next_round(self) -> tuple[int, torch.Tensor]:
        """The next round's number and its set of slots [size, chunk_bytes]."""
        self._round += 1
        return self._round, self._slots[self._round & 1]

    def _await(self, round_: int) -> None:
        flags = self._flags
        self._waiter.wait(lambda: int(flags.min()) >= round_)

    def _exchange(self, data: torch.Tensor | None) -> torch.Tensor:
        """One round: ``data`` (flat bytes, at most a chunk; None: nothing to give) into this rank's slot; returns
        the round's slots [size, chunk_bytes] once every rank has published."""
        round_, slots = self._next_round()
        if data is not None:
            slots[self.rank, :data.numel()].copy_(data)
        fence()
        self._flags[self.rank] = round_
        self._await(round_)
        return slots

    def _pieces(self, tensor: torch.Tensor):
        """(flat element range, its bytes) per round: rounds of at most a chunk."""
        flat = tensor.reshape(-1)
        per_round = self.chunk_bytes // tensor.element_size()
        for start in range(0, flat.numel(), per_round):
            piece = flat[start:start + per_round]
            yield piece, piece.view(torch.uint8)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        assert tensor.is_contiguous()
        kernels = _reduce_kernels(tensor)
        for piece, data in self._pieces(tensor):
            if kernels is None:  # no C++ compiler, or another dtype: the same round in PyTorch
                slots = self._exchange(data)
                parts = [slots[rank, :data.numel()].view(tensor.dtype) for rank in range(self.size)]
                total = parts[0].to(torch.float32, copy=True)  # (a copy: slot 0 is rank 0's part, read by all)
                for part in parts[1:]:
                    total += part
                piece.copy_(total)
                continue
            reduce, add_up = kernels
            round_, slots = self._next_round()
            if not reduce(slots.data_ptr(), self._published.ctypes.data, _STRIDE, self.rank, self.size, round_,
                          piece.data_ptr(), piece.numel(), self.chunk_bytes, SPIN_NS):
                self._await(round_)  # the others are late: nap, checking they live
                add_up(slots.data_ptr(), self.size, piece.data_ptr(), piece.numel(), self.chunk_bytes)

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == 0 else None
        start = 0
        for piece, data in self._pieces(tensor):
            slots = self._exchange(data)
            if out is not None:
                for rank, whole in enumerate(out):
                    whole.view(-1)[start:start + piece.numel()].view(torch.uint8).copy_(slots[rank, :data.numel()])
            start += piece.numel()
        return out

    def broadcast(self, tensor: torch.Tensor) -> None:
        assert tensor.is_contiguous()
        for piece, data in self._pieces(tensor):
            slots = self._exchange(data if self.rank == 0 else None)
            if self.rank:
                data.copy_(slots[0, :data.numel()])

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value``."""
        slots = self._exchange(torch.tensor([value], dtype=torch.int64).view(torch.uint8))
        return int(slots[:, :8].contiguous().view(torch.int64).min())

    def close(self) -> None:
        self._slots = self._flags = self._published = self._pids = None
        self.region.close()


def _reduce_kernels(tensor: torch.Tensor):
    """(``shm_all_reduce``, ``shm_sum``) of the CPU kernels for ``tensor``'s dtype, or None."""
    if tensor.device.type != "cpu" or tensor.dtype not in cpu_kernels.SUFFIXES:
        return None
    lib = cpu_kernels.load()
    if lib is None:
        return None
    suffix = cpu_kernels.SUFFIXES[tensor.dtype]
    return getattr(lib, f"shm_all_reduce_{suffix}"), getattr(lib, f"shm_sum_{suffix}")


class TorchCollectives:
    """The same operations on a ``torch.distributed`` process group object (``nccl`` or ``gloo``)."""

    def __init__(self, group, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size

    @classmethod
    def connect(cls, store, rank: int, size: int, backend: str,
                timeout: datetime.timedelta = datetime.timedelta(minutes=10)) -> TorchCollectives:
        if backend == "nccl":
            group = dist.ProcessGroupNCCL(store, rank, size)
        else:
            group = dist.ProcessGroupGloo(store, rank, size, timeout)
        return cls(group, rank, size)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        self.group.allreduce([tensor]).wait()

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        tensor = tensor.contiguous()
        out = [[torch.empty_like(tensor) for _ in range(self.size)]] if self.rank == 0 else []
        options = dist.GatherOptions()
        options.rootRank = 0
        self.group.gather(out, [tensor], options).wait()
        return out[0] if self.rank == 0 else None

    def broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()

    def close(self) -> None:
        self.group = None
