"""A replica's tensor-parallel ranks: rank 0 is the engine's own model runner (scheduler, sampler, the only one the
engine talks to); ranks 1..N-1 are worker processes, each a ``ModelRunner`` holding its shard and its own KV cache.

Each step rank 0 puts the scheduler's output (block tables as what changed, ``step_channel``) in the step channel
before computing it; every worker runs the same ``ModelRunner.launch`` on it with no sampler, so the ranks make the
same collectives in the same order (``collectives``); rank 0 alone samples. Workers start with ``spawn``, never
``fork`` (a forked gloo or OpenMP runtime deadlocks), and end when told, or when rank 0 dies (their wait notices
within a fraction of a second). The shared memory's files are removed as soon as every rank has attached them, so
none is left behind however the processes end.

Placement: where the process may run on several CPUs, they are dealt to the ranks in contiguous parts (each rank's
compute threads on its own cores); a rank's thread count is ``num_threads``, else its part's size.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import pickle
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from inflight.engine.config import EngineConfig
from inflight.engine.device import resolve_device
from inflight.engine.parallel.collectives import Collectives, ShmCollectives, TorchCollectives
from inflight.engine.parallel.shm import PeerLost
from inflight.engine.parallel.step_channel import StepChannel, StepDecoder, StepEncoder
from inflight.engine.scheduler_output import PrefillBatch, SchedulerOutput

logger = logging.getLogger(__name__)

STORE_TIMEOUT = datetime.timedelta(minutes=10)  # a rank loading a large checkpoint


@dataclass(frozen=True)
class RankSetup:
    """What a worker needs to join (sent to its process): the rest (the engine's config, ``max_model_len``, the
    shared memory's names) it reads from rank 0's store."""

    rank: int
    size: int
    store_port: int
    cpus: tuple[int, ...] | None = None


@dataclass
class TensorParallel:
    """This process's place among the ranks: ``shm`` (the ranks' pids, liveness, small host exchanges) and ``comm``
    (the model's tensors: ``shm`` itself between CPU ranks, a ``torch.distributed`` group otherwise); on rank 0,
    ``workers`` drives the others."""

    rank: int
    size: int
    shm: ShmCollectives
    comm: Collectives
    cpus: tuple[int, ...] | None = None
    workers: RankWorkers | None = None

    @property
    def threads(self) -> int | None:
        return len(self.cpus) if self.cpus else None

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()


def cpu_parts(cpus: list[int], size: int) -> list[tuple[int, ...] | None]:
    """Each rank's CPUs: contiguous parts of ``cpus`` when there are at least ``size``, else no pinning."""
    if len(cpus) < size:
        return [None] * size
    return [tuple(cpus[r * len(cpus) // size:(r + 1) * len(cpus) // size]) for r in range(size)]


def start_ranks(config: EngineConfig, max_model_len: int) -> TensorParallel:
    """Rank 0's side: the rendezvous store (on ``tensor_parallel_port``, else any free port), the shared memory, and,
    with ``tensor_parallel_workers="local"``, the worker processes (loading while rank 0 does); "external" ones are
    started by whoever chose the port, and join through the store."""
    size = config.tensor_parallel_size
    store = dist.TCPStore("127.0.0.1", config.tensor_parallel_port or 0, size, True, timeout=STORE_TIMEOUT,
                          wait_for_workers=False)
    shm = ShmCollectives.create(size)
    channel = StepChannel.create(size - 1)
    store.set("collectives", shm.region.name)
    store.set("steps", channel.region.name)
    store.set("engine", pickle.dumps((config, max_model_len)))
    local = config.tensor_parallel_workers == "local"
    parts = (cpu_parts(sorted(os.sched_getaffinity(0)), size) if local and hasattr(os, "sched_getaffinity")
             else [None] * size)
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=worker_main, name=f"inflight-tp-rank-{rank}", daemon=True,
                                 args=(RankSetup(rank, size, store.port, parts[rank]),))
                 for rank in range(1, size)] if local else []
    for process in processes:
        process.start()
    workers = RankWorkers(processes, channel, shm, store)
    shm.watch(workers.check)  # a local worker that dies before joining is noticed too
    logger.info("tensor parallel: %d ranks (%s)", size,
                f"workers' pids {[p.pid for p in processes]}" if local else f"workers join on port {store.port}")
    try:  # (after the workers start: a torch.distributed group forms once every rank has joined)
        comm = tensor_collectives(config, store, 0, size, shm)
    except BaseException:
        workers.close()
        raise
    return TensorParallel(0, size, shm, comm, parts[0], workers)


def tensor_collectives(config: EngineConfig, store, rank: int, size: int, shm: ShmCollectives) -> Collectives:
    """What carries the model's tensors between ranks (``tensor_parallel_backend``): shared memory between CPU ranks
    ("auto"), NCCL between GPUs ("auto" on CUDA), or gloo (CPU ranks through ``torch.distributed``; tests and
    comparisons)."""
    backend = config.tensor_parallel_backend
    if backend == "auto":
        backend = "nccl" if resolve_device(config.device).type == "cuda" else "shm"
    if backend == "shm":
        return shm
    return TorchCollectives.connect(dist.PrefixStore(backend, store), rank, size, backend)


class RankWorkers:
    """Rank 0's handle on the other ranks: their step messages, their liveness, their shutdown."""

    def __init__(self, processes: list, channel: StepChannel, shm: ShmCollectives, store) -> None:
        self.processes, self.channel, self.shm, self.store = processes, channel, shm, store
        self._encoder = StepEncoder()
        self._finalizer = weakref.finalize(self, _stop, processes, channel, shm)

    def check(self) -> None:
        """``PeerLost`` if a worker has ended (a local process by its exit code; any rank by its pid)."""
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                raise PeerLost(f"tensor parallel: rank {rank} (pid {process.pid}) has died "
                               f"(exit code {process.exitcode})")
        self.shm.check_pids()

    def send_step(self, batch: SchedulerOutput, greedy: bool) -> None:
        """``greedy``: every row samples plain greedy (the ranks compare their best tokens, not their logits). (No
        liveness check per step: a dead rank is found by whichever wait it holds up, the ring's or a collective's.)"""
        self.channel.put(("step", (self._encoder.encode(batch), greedy)), self.check)

    def send_prefill(self, batch: PrefillBatch) -> None:
        self.channel.put(("prefill", batch), self.check)

    def joined(self) -> None:
        """Every rank has attached the shared memory (after the first collective): its files can go now."""
        self.shm.region.unlink()
        self.channel.region.unlink()

    def close(self) -> None:
        """Stop the workers and free the shared memory (idempotent)."""
        self._finalizer()


def _stop(processes: list, channel: StepChannel, shm: ShmCollectives, timeout_s: float = 10.0) -> None:
    if all(p.exitcode is None for p in processes):
        try:
            channel.put(("stop", None), lambda: None)
        except (PeerLost, ValueError):
            pass
    for process in processes:
        process.join(timeout_s)
        if process.exitcode is None:
            process.kill()
            process.join()
    channel.close()
    shm.close()


def worker_main(setup: RankSetup) -> None:
    """A worker process: join, build this rank's model runner, then run rank 0's steps until told to stop."""
    from inflight.engine.model_runner import ModelRunner
    from inflight.engine.models.source import read_model_source

    if setup.cpus:
        os.sched_setaffinity(0, setup.cpus)  # before torch starts its compute threads, which inherit it
    store = dist.TCPStore("127.0.0.1", setup.store_port, setup.size, False, timeout=STORE_TIMEOUT)
    config, max_model_len = pickle.loads(store.get("engine"))
    shm = ShmCollectives.attach(store.get("collectives").decode(), setup.rank, setup.size)
    channel = StepChannel.attach(store.get("steps").decode(), setup.size - 1, setup.rank - 1)
    try:
        if resolve_device(config.device).type == "cuda" and torch.cuda.device_count() > 1:
            torch.cuda.set_device(setup.rank)  # spawned beside rank 0: every GPU visible (a Ray actor sees its own)
        comm = tensor_collectives(config, store, setup.rank, setup.size, shm)
        parallel = TensorParallel(setup.rank, setup.size, shm, comm, setup.cpus)
        runner = ModelRunner(config, read_model_source(config.model), max_model_len, parallel=parallel)
        serve_steps(runner, channel)
    except PeerLost:  # (rank 0 died, perhaps before every rank had joined: its files go here then)
        shm.region.unlink()
        channel.region.unlink()
        logger.warning("tensor parallel rank %d: rank 0 has gone; stopping", setup.rank)
    finally:
        channel.close()
        shm.close()


def serve_steps(runner, channel: StepChannel) -> None:
    decoder = StepDecoder()
    while True:
        kind, payload = channel.get()
        if kind == "step":
            batch, greedy = payload
            runner.launch(decoder.decode(batch), None, greedy)
        elif kind == "prefill":
            runner.execute_prefill(payload)
        elif kind == "stop":
            return
        else:
            raise TypeError(f"not a step message: {kind!r}")


