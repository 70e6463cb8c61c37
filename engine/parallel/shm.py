"""Shared memory for the ranks of one node, and the one way anything here waits for another process.

A region is a file rank 0 creates under a fresh name and attached by the others; counters in it are 8-byte words that one
process writes and the others read. Data is written before the counter that publishes it, with a fence between (x86
keeps stores in order anyway; the fence keeps it true elsewhere).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import tempfile
import threading
import time
from typing import Callable

import numpy as np

_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier (a lock's acquire and release are atomic operations)."""
    with _fence_lock:
        pass


class Region:
    """A shared memory file (in /dev/shm where there is one) mapped into this process: ``create`` (the owner, who
    removes it) or ``attach`` (by name). Plain files rather than ``multiprocessing.shared_memory``, whose resource
    tracker unlinks a block when any process that attached it exits."""

    def __init__(self, path: str, owner: bool) -> None:
        self.path, self.owner = path, owner
        fd = os.open(path, os.O_RDWR)
        try:
            self.memory = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.buf = memoryview(self.memory)

    @classmethod
    def create(cls, nbytes: int, prefix: str = "inflight") -> Region:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(folder, f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        return cls(path, owner=True)

    @classmethod
    def attach(cls, name: str) -> Region:
        return cls(name, owner=False)

    @property
    def name(self) -> str:
        return self.path

    def words(self, offset: int, count: int) -> np.ndarray:
        """``count`` uint64 counters at ``offset`` (8-aligned)."""
        return np.ndarray((count,), dtype=np.uint64, buffer=self.buf, offset=offset)

    def unlink(self) -> None:
        """Remove the file (the mappings stay): once every process has attached, nothing needs the name, and no
        file is left behind however the processes end."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        """Unmap (once no view of it is left: otherwise the mapping goes with the process) and, the owner, remove."""
        if self.owner:
            self.unlink()
        self.buf.release()
        with contextlib.suppress(BufferError):
            self.memory.close()


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


class PeerLost(RuntimeError):
    """A process this one waits on has died, or the wait outlasted its timeout."""


class Waiter:
    """Waits for a condition another process makes true: spins for ``spin_s`` (a step's collectives and the next
    step's message come within milliseconds while serving), then sleeps in growing naps up to ``max_nap_s``, and
    after ``idle_after_s`` of waiting up to ``idle_nap_s``: an idle rank wakes ~50 times a second, 0.6% of a core
    measured (1.9% at 2 ms naps), and the first step after an idle second waits at most one nap more. ``alive`` is
    called every ``check_every_s`` and raises ``PeerLost`` if the process waited on has died."""

    def __init__(self, alive: Callable[[], None], spin_s: float = 2e-3, max_nap_s: float = 2e-3,
                 idle_after_s: float = 1.0, idle_nap_s: float = 0.02, check_every_s: float = 0.2) -> None:
        self.alive, self.spin_s, self.max_nap_s = alive, spin_s, max_nap_s
        self.idle_after_s, self.idle_nap_s, self.check_every_s = idle_after_s, idle_nap_s, check_every_s

    def wait(self, ready: Callable[[], bool]) -> None:
        if ready():
            return
        started = time.monotonic()
        checked, nap = started, 5e-5
        while not ready():
            now = time.monotonic()
            if now - started < self.spin_s:
                os.sched_yield()
                continue
            if now - checked >= self.check_every_s:
                self.alive()  # raises PeerLost
                checked = now
            time.sleep(nap)
            nap = min(nap * 2, self.max_nap_s if now - started < self.idle_after_s else self.idle_nap_s)
        fence()
