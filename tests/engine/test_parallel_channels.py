"""engine.parallel's shared-memory channels, in processes as the ranks use them: the collectives' results against
plain PyTorch (and against ``torch.distributed``'s gloo on the same inputs), rounds larger than a slot, a peer's
death ending a wait with ``PeerLost``; the step channel's order and large messages; block tables sent as changes."""

from __future__ import annotations

import random
import subprocess
import sys
import threading

import pytest
import torch

from inflight.engine.parallel.collectives import ShmCollectives, TorchCollectives
from inflight.engine.parallel.shm import PeerLost
from inflight.engine.parallel.step_channel import SLOT_BYTES, StepChannel, StepDecoder, StepEncoder
from inflight.engine.scheduler_output import SchedulerOutput

SIZE = 3  # three ranks: sums of more than two parts, in rank order
CHUNK = 4096  # small rounds, so most tensors here take several


def _inputs(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return {"f32": torch.randn(33, 70, generator=g),  # 9,240 bytes: three rounds
            "bf16": torch.randn(5, 300, generator=g).to(torch.bfloat16),
            "one": torch.randn(1, 7, generator=g)}


def _collectives_rank(rank: int, region: str, port: int, out: str) -> None:
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    shm = ShmCollectives.attach(region, rank, SIZE, chunk_bytes=CHUNK)
    store = dist.TCPStore("127.0.0.1", port, SIZE, rank == 0, timeout=datetime.timedelta(seconds=60))
    gloo = TorchCollectives.connect(store, rank, SIZE, "gloo")
    results = {}
    for name, tensor in _inputs(rank).items():
        for kind, comm in (("shm", shm), ("gloo", gloo)):
            summed = tensor.clone()
            comm.all_reduce(summed)
            results[f"{kind}-sum-{name}"] = summed
            results[f"{kind}-gather-{name}"] = comm.gather(tensor)
            sent = tensor.clone()
            comm.broadcast(sent)
            results[f"{kind}-broadcast-{name}"] = sent
    results["shm-min"] = shm.min_int(50 - 7 * rank)
    torch.save(results, f"{out}/rank{rank}.pt")
    shm.close()


@pytest.mark.parametrize("cpu_kernels", ["1", "0"], ids=["c++-round", "pytorch-round"])
def test_collectives_give_every_rank_the_sum_in_rank_order_and_agree_with_gloo(tmp_path, monkeypatch, cpu_kernels):
    import socket

    import torch.multiprocessing as mp

    monkeypatch.setenv("INFLIGHT_CPU_KERNELS", cpu_kernels)  # (the ranks' processes read it)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    owner = ShmCollectives.create(SIZE, chunk_bytes=CHUNK)
    try:
        mp.start_processes(_collectives_rank, args=(owner.region.name, port, str(tmp_path)), nprocs=SIZE,
                           start_method="spawn")
    finally:
        owner.close()
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(SIZE)]
    inputs = [_inputs(rank) for rank in range(SIZE)]
    for name in inputs[0]:
        # in rank order and in float32, rounded once, as every rank adds them
        expected = (inputs[0][name].float() + inputs[1][name].float() + inputs[2][name].float()).to(inputs[0][name].dtype)
        for rank in range(SIZE):
            assert torch.equal(results[rank][f"shm-sum-{name}"], expected), (name, rank)
            tolerance = 5e-2 if name == "bf16" else 1e-5  # gloo sums in its own order (bf16: a few ulps)
            assert torch.allclose(results[rank][f"gloo-sum-{name}"].float(), expected.float(), atol=tolerance)
            assert torch.equal(results[rank][f"shm-broadcast-{name}"], inputs[0][name])
            assert torch.equal(results[rank][f"gloo-broadcast-{name}"], inputs[0][name])
            if rank:
                assert results[rank][f"shm-gather-{name}"] is None
        for kind in ("shm", "gloo"):
            assert all(torch.equal(a, b) for a, b in zip(results[0][f"{kind}-gather-{name}"],
                                                        [inputs[r][name] for r in range(SIZE)]))
    assert {results[rank]["shm-min"] for rank in range(SIZE)} == {50 - 7 * 2}


def _rank_that_leaves(rank: int, region: str) -> None:
    comm = ShmCollectives.attach(region, rank, 2)
    if rank == 1:
        return  # dies without taking part
    try:
        comm.all_reduce(torch.ones(4))
    except PeerLost as e:
        assert "rank 1" in str(e)
        return
    raise AssertionError("all_reduce returned without rank 1")


def test_a_rank_waiting_on_a_dead_peer_gets_peer_lost(tmp_path):
    import torch.multiprocessing as mp

    owner = ShmCollectives.create(2)
    try:
        mp.start_processes(_rank_that_leaves, args=(owner.region.name,), nprocs=2, start_method="spawn")
    finally:
        owner.close()


def test_the_step_channel_delivers_every_message_in_order_to_every_reader():
    writer = StepChannel.create(num_readers=2)
    readers = [StepChannel.attach(writer.region.name, 2, reader) for reader in range(2)]
    rng = random.Random(0)
    # small steps and messages of several slots (the ring holds 8): the writer waits for the readers to free them
    messages = [("step", bytes(rng.randrange(256) for _ in range(rng.choice([10, 1000]))))
                for _ in range(40)] + [("big", bytes(3 * SLOT_BYTES + 17))] * 4 + [("stop", None)]
    got: list[list] = [[], []]

    def read(index: int) -> None:
        while True:
            message = readers[index].get()
            got[index].append(message)
            if message[0] == "stop":
                return

    threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for message in messages:
        writer.put(message, lambda: None)
    for thread in threads:
        thread.join(30)
    assert got[0] == messages and got[1] == messages
    for channel in (*readers, writer):
        channel.close()


def test_a_reader_whose_writer_died_gets_peer_lost():
    writer = StepChannel.create(num_readers=1)
    reader = StepChannel.attach(writer.region.name, 1, 0)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    writer._writer_pid[0] = gone.pid  # as if the writer were that finished process
    with pytest.raises(PeerLost, match="rank 0"):
        reader.get()
    reader.close()
    writer.close()


def test_block_tables_travel_as_their_changes_and_arrive_whole():
    encoder, decoder = StepEncoder(), StepDecoder()
    rng = random.Random(1)
    tables: dict[str, list[int]] = {}
    sent_entries = 0
    for step in range(200):
        for request_id in list(tables):
            roll = rng.random()
            if roll < 0.05:
                del tables[request_id]  # ended
            elif roll < 0.08:
                tables[request_id] = [rng.randrange(1000) for _ in range(rng.randrange(1, 6))]  # recomputed
            elif roll < 0.3:
                tables[request_id].append(rng.randrange(1000))  # filled a block
        if rng.random() < 0.3:
            tables[f"r{step}"] = [rng.randrange(1000) for _ in range(rng.randrange(0, 4))]
        ids = [r for r in tables if rng.random() < 0.9]  # some requests sit a step out
        batch = SchedulerOutput(request_ids=ids, block_tables=[list(tables[r]) for r in ids])
        encoded = encoder.encode(batch)
        sent_entries += sum(len(c[0]) if isinstance(c, tuple) else len(c) for c in encoded.block_tables)
        assert decoder.decode(encoded).block_tables == batch.block_tables
    whole = sum(len(t) for t in tables.values()) * 200
    assert sent_entries < whole / 4  # (changes only: most steps send nothing for most rows)
