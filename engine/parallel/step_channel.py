"""Rank 0's step messages to the other ranks: a queue in shared memory with one writer and many readers.

A ring of slots, each with the number of the message piece it holds; every reader publishes the last piece it has
read, and the writer reuses a slot once every reader is past it. A message larger than a slot goes in consecutive
pieces. Readers wait with ``shm.Waiter``: spinning for a moment after each message (the next step follows within
milliseconds while serving), then napping, so an idle replica's ranks sleep.

What goes through it is pickled; ``StepEncoder`` first replaces each row's block table by what changed since the
row's previous step (nothing, most steps; a block appended when a row fills one), which ``StepDecoder`` restores.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from typing import Any

from inflight.engine.parallel.shm import PeerLost, Region, Waiter, fence, process_alive
from inflight.engine.scheduler_output import SchedulerOutput

SLOT_BYTES = 1 << 20
NUM_SLOTS = 8
_HEADER_WORDS = 8  # per slot: piece number, length, more pieces follow; per reader: last piece read; writer pid


class StepChannel:
    """Messages from the writer (rank 0) to ``num_readers`` readers, in order, each read by every reader."""

    def __init__(self, region: Region, num_readers: int, reader: int | None) -> None:
        self.region, self.num_readers, self.reader = region, num_readers, reader  # reader None: the writer
        self._slot_words = region.words(0, NUM_SLOTS * _HEADER_WORDS).reshape(NUM_SLOTS, _HEADER_WORDS)
        self._read = region.words(NUM_SLOTS * _HEADER_WORDS * 8, num_readers * _HEADER_WORDS)[::_HEADER_WORDS]
        self._writer_pid = region.words((NUM_SLOTS + num_readers) * _HEADER_WORDS * 8, 1)
        self._data_offset = (NUM_SLOTS + num_readers + 1) * _HEADER_WORDS * 8
        if reader is None:
            self._writer_pid[0] = os.getpid()
        self._piece = 0
        self._waiter = Waiter(self._check_writer)

    @classmethod
    def region_bytes(cls, num_readers: int) -> int:
        return (NUM_SLOTS + num_readers + 1) * _HEADER_WORDS * 8 + NUM_SLOTS * SLOT_BYTES

    @classmethod
    def create(cls, num_readers: int) -> StepChannel:
        return cls(Region.create(cls.region_bytes(num_readers), "inflight-steps"), num_readers, None)

    @classmethod
    def attach(cls, name: str, num_readers: int, reader: int) -> StepChannel:
        return cls(Region.attach(name), num_readers, reader)

    def _check_writer(self) -> None:
        pid = int(self._writer_pid[0])
        if not process_alive(pid):
            raise PeerLost(f"tensor parallel: rank 0 (pid {pid}) has died")

    def _data(self, slot: int) -> memoryview:
        start = self._data_offset + slot * SLOT_BYTES
        return self.region.buf[start:start + SLOT_BYTES]

    def put(self, message: Any, alive) -> None:
        """Pickle ``message`` and queue it for every reader; ``alive`` raises if a reader has died (while the ring
        is full)."""
        payload = memoryview(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        waiter = Waiter(alive)
        for start in range(0, max(len(payload), 1), SLOT_BYTES):
            piece = payload[start:start + SLOT_BYTES]
            self._piece += 1
            number, slot = self._piece, self._piece % NUM_SLOTS
            read = self._read
            waiter.wait(lambda: int(read.min()) >= number - NUM_SLOTS)
            self._data(slot)[:len(piece)] = piece
            words = self._slot_words[slot]
            words[1], words[2] = len(piece), start + SLOT_BYTES < len(payload)
            fence()
            words[0] = number

    def get(self) -> Any:
        """The next message (waits for it; ``PeerLost`` if the writer dies meanwhile)."""
        pieces = []
        while True:
            self._piece += 1
            number, slot = self._piece, self._piece % NUM_SLOTS
            words = self._slot_words[slot]
            self._waiter.wait(lambda: int(words[0]) == number)
            length, more = int(words[1]), bool(words[2])
            pieces.append(bytes(self._data(slot)[:length]))
            fence()
            self._read[self.reader] = number
            if not more:
                return pickle.loads(b"".join(pieces))

    def close(self) -> None:
        self._slot_words = self._read = self._writer_pid = None
        self.region.close()


class StepEncoder:
    """Rank 0's side: a batch with each row's block table as its change since the row's previous step."""

    def __init__(self) -> None:
        self._tables: dict[str, list[int]] = {}

    def encode(self, batch: SchedulerOutput) -> SchedulerOutput:
        known, changes = self._tables, []
        for request_id, table in zip(batch.request_ids, batch.block_tables):
            before = known.get(request_id)
            if before is not None and len(before) <= len(table) and table[:len(before)] == before:
                changes.append(table[len(before):])  # appended blocks (usually none)
            else:
                changes.append((table,))  # new or rewritten: whole
        self._tables = dict(zip(batch.request_ids, batch.block_tables))
        return dataclasses.replace(batch, block_tables=changes)


class StepDecoder:
    """A rank's side: the whole block tables back from ``StepEncoder``'s changes."""

    def __init__(self) -> None:
        self._tables: dict[str, list[int]] = {}

    def decode(self, batch: SchedulerOutput) -> SchedulerOutput:
        tables = []
        for request_id, change in zip(batch.request_ids, batch.block_tables):
            if isinstance(change, tuple):
                tables.append(change[0])
            else:
                tables.append(self._tables[request_id] + change)
        self._tables = dict(zip(batch.request_ids, tables))
        return dataclasses.replace(batch, block_tables=tables)
