"""The step loop that ``AsyncLLMEngine`` drives: on a thread of its own, or in a process of its own.

One loop, ``run_step_loop``, whichever it runs on: it takes commands (add requests, abort one, end one at a
stop string, stop) between steps, runs the engine's core steps back to back while there is work, and reports
after each step (``StepReport``: the core's records of new tokens and ends, the requests refused at admission,
the step's time and rows, and now and then the engine's stats and queue view). The caller's front end
(``engine.output_processor``) turns the records into text and outputs, so the loop never detokenizes. Only two
small functions differ, how commands come in and how reports go out:

* ``StepThread``: a thread of the caller's process, commands in a locked list (the engine shares the
  process, and its GIL, with the caller);
* ``EngineCoreProcess``: a child process (``python -m engine.engine_core_child``) connected by a local socket,
  commands and reports pickled across it. The server's process then spends its interpreter on HTTP,
  streaming and Ray, and never holds the engine's steps back for the GIL (vLLM's V1 engine core is the same
  idea). The child exits when the socket closes, so it never outlives its server.

Reports carry ``applied_seq``: the last add command the engine has taken in. Admission in the caller counts
what it has sent since as queued ahead (see ``AsyncLLMEngine._check_deadline_now``).
"""

from __future__ import annotations

import atexit
import gc
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Callable

from inflight.engine.core_messages import (AbortRequest, AddRequests, Command, CoreDied, CoreFailed, CoreReady,
                                           CoreStart, FinishStopped, Refusal, StepReport, StopLoop)
from inflight.engine.outputs import DeadlineUnmeetableError

IDLE_WAIT_S = 0.5  # how often an idle loop looks up (new work wakes it at once)
STATS_PERIOD_S = 0.05  # how fresh stats and the queue view are while steps run (they walk the queues)
GC_YOUNG_THRESHOLD = 20_000  # new container objects before a young collection (settle_heap)
START_TIMEOUT_S = 600.0  # loading a large checkpoint takes a while
AUTHKEY_ENV = "INFLIGHT_ENGINE_CORE_AUTHKEY"


class EngineDied(Exception):
    """The engine's process ended: with an error (its repr, which crossed the process boundary as text), or by
    exiting."""


def run_step_loop(engine, receive: Callable[[bool], list[Command]], report: Callable[[StepReport], None]) -> None:
    """Run ``engine`` (an ``LLMEngine``) until a ``StopLoop`` command. ``receive(wait)`` returns the commands
    (core_messages) sent since its last call, waiting up to ``IDLE_WAIT_S`` for one if ``wait``; ``report`` hands
    a ``StepReport`` to the caller, whose front end (``OutputProcessor``) makes the outputs."""
    applied_seq, stats_time = 0, 0.0
    while True:
        idle = not engine.has_unfinished_requests()
        if idle:
            engine.check_ranks()  # a rank lost while idle fails the engine now, not at its next request
        refused, added = [], False
        for command in receive(idle):
            kind = type(command)
            if kind is AddRequests:
                applied_seq, added = command.seq, True
                try:
                    engine.enqueue_core(command.requests)
                except (ValueError, DeadlineUnmeetableError) as e:
                    refused.append(Refusal(command.requests[0].parent_id, e))
            elif kind is AbortRequest:
                engine.abort_request(command.request_id)
            elif kind is FinishStopped:
                engine.finish_stopped(command.request_id, command.stop)
            elif kind is StopLoop:
                return
            else:
                raise TypeError(f"not an engine core command: {command!r}")
        if not engine.has_unfinished_requests():
            if added or refused or not idle:  # news: what was added ended at once, or the last request ended
                report(StepReport(refused=refused, stats=engine.stats(), view=engine.queue_view(),
                                  applied_seq=applied_seq))
            continue
        started = time.perf_counter()
        records = engine.core_step()
        finished = time.perf_counter()
        # Stats fresh at least every period, after new requests are in, and before the outputs that leave the engine
        # idle are delivered: whoever awaited the last result must not read stats from before it.
        stats = view = None
        if added or finished - stats_time >= STATS_PERIOD_S or not engine.has_unfinished_requests():
            stats, view, stats_time = engine.stats(), engine.queue_view(), finished
        report(StepReport(records, refused, finished - started, engine.last_batch_size, stats, view, applied_seq))


def settle_heap() -> None:
    """Before a process's step loop: what exists now (the model, the tokenizer, every module) lives as long as
    the process, so it leaves the cyclic collector's sight (``gc.freeze``), and the youngest generation waits
    for ``GC_YOUNG_THRESHOLD`` new objects instead of 700: a step makes a few objects per request and drops
    nearly all by the end of the step, so they die by reference count before any collection scans them
    (at 256 requests the default threshold ran a collection every ~3 steps, mid-step)."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)  # let the interpreter's last collection free it all at exit
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


# -- on a thread ------------------------------------------------------------------------------------------
class StepThread:
    """The loop on a daemon thread of this process; ``on_report`` is called on that thread."""

    def __init__(self, engine, on_report: Callable[[StepReport], None], on_death: Callable[[BaseException], None]):
        self.engine = engine
        self._commands: list[Command] = []
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._on_report, self._on_death = on_report, on_death
        self._thread = threading.Thread(target=self._run, name="inflight-step", daemon=True)
        self._thread.start()

    def send(self, command: Command) -> None:
        with self._lock:
            self._commands.append(command)
        self._work.set()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _receive(self, wait: bool) -> list[Command]:
        if wait:
            self._work.wait(IDLE_WAIT_S)
        self._work.clear()
        with self._lock:
            commands, self._commands = self._commands, []
        return commands

    def _run(self) -> None:
        try:
            run_step_loop(self.engine, self._receive, self._on_report)
        except BaseException as e:  # the loop is dead: fail every waiter rather than hang it
            self._on_death(e)


# -- in a process -----------------------------------------------------------------------------------------
class EngineCoreProcess:
    """Starts ``python -m engine.engine_core_child`` with the engine's arguments (and the CPUs it may run on,
    ``cpus``, when it should have cores of its own) and waits until it is ready: the model is loaded and the
    pool sized (``info``: the engine's config, ``max_model_len`` and its note, the first stats). A bad argument raises ``ValueError`` here, as
    ``LLMEngine`` would. Reports arrive on a reader thread (``on_report``, then ``on_death`` once it ends)."""

    def __init__(self, model: str, engine_args: dict[str, Any], on_report: Callable[[StepReport], None],
                 on_death: Callable[[BaseException], None], cpus: set[int] | None = None) -> None:
        self._socket_dir = tempfile.mkdtemp(prefix="inflight-core-")
        address = os.path.join(self._socket_dir, "core.sock")
        authkey = secrets.token_bytes(32)
        listener = Listener(address, family="AF_UNIX", authkey=authkey)
        env = {**os.environ, AUTHKEY_ENV: authkey.hex()}
        self._process = subprocess.Popen([sys.executable, "-m", "inflight.engine.engine_core_child", address], env=env,
                                         stdin=subprocess.DEVNULL)
        self._stopping = False
        try:
            self._conn = _accept(listener, self._process)
            self._conn.send(CoreStart(model, engine_args, cpus))
            try:
                answer = self._conn.recv()  # CoreReady or CoreFailed
            except EOFError:  # it died while loading (killed for memory, a crash in native code)
                raise RuntimeError(f"the engine process exited ({self._process.wait(10)}) while it was loading "
                                   f"the model; its log is the replica's") from None
        except BaseException:
            self._process.kill()
            raise
        finally:
            listener.close()  # removes the socket file; the connection lives on without it
            _remove_dir(self._socket_dir)
        if isinstance(answer, CoreFailed):
            self._process.wait(10)
            raise (ValueError if answer.error_type == "ValueError" else RuntimeError)(answer.message)
        self.info: CoreReady = answer
        self._send_lock = threading.Lock()
        self._on_report, self._on_death = on_report, on_death
        self._reader = threading.Thread(target=self._read, name="inflight-core-reader", daemon=True)
        self._reader.start()

    def send(self, command: Command) -> None:
        with self._send_lock:  # the event loop and a shutdown may send at once
            self._conn.send(command)

    def alive(self) -> bool:
        return self._process.poll() is None and self._reader.is_alive()

    def join(self, timeout: float) -> None:
        self._stopping = True
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(5)
        self._reader.join(timeout)
        self._conn.close()

    def _read(self) -> None:
        conn = self._conn
        try:
            while True:
                message = conn.recv()
                if isinstance(message, StepReport):
                    self._on_report(message)
                elif isinstance(message, CoreDied):
                    raise EngineDied(message.reason)
        except (EOFError, OSError) as e:
            if not self._stopping:
                self._on_death(EngineDied(f"the engine process exited ({self._process.poll()}): {e!r}"))
        except BaseException as e:
            self._on_death(e)


def _remove_dir(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


def _accept(listener: Listener, process: subprocess.Popen) -> Connection:
    """The child's connection, or an error once it has exited without connecting (or after START_TIMEOUT_S)."""
    accepted: list = []
    thread = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while thread.is_alive():
        thread.join(0.2)
        if process.poll() is not None and not accepted:
            raise RuntimeError(f"the engine process exited ({process.returncode}) before it connected")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine process did not connect in {START_TIMEOUT_S:.0f} s")
    return accepted[0]


def child_main(address: str) -> int:
    """The engine's process (``engine.engine_core_child``): connect, build the engine, run the loop."""
    conn = Client(address, family="AF_UNIX", authkey=bytes.fromhex(os.environ.pop(AUTHKEY_ENV)))
    start: CoreStart = conn.recv()
    cpus = start.cpus
    try:
        if cpus:  # before the engine starts its compute threads, which inherit the mask
            os.sched_setaffinity(0, cpus)
        from inflight.engine.llm_engine import LLMEngine

        engine = LLMEngine(start.model, **start.engine_args)
    except Exception as e:  # a bad argument: the server raises it as the in-process engine would
        if isinstance(e, OSError) and cpus:
            e = ValueError(f"engine_cpus: cannot run on CPUs {sorted(cpus)}: {e.strerror}")
        conn.send(CoreFailed(type(e).__name__, str(e)))
        return 1
    conn.send(CoreReady(engine.config, engine.max_model_len, engine._max_model_len_note, engine.stats()))

    def receive(wait: bool) -> list[Command]:
        commands = []
        if wait:
            conn.poll(IDLE_WAIT_S)
        while conn.poll():
            commands.append(conn.recv())  # EOFError when the server has gone: the loop ends with it
        return commands

    settle_heap()
    try:
        run_step_loop(engine, receive, conn.send)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return 0  # the server went away
    except BaseException as e:
        try:
            conn.send(CoreDied(repr(e)))
        finally:
            raise
    finally:
        engine.close()  # the process ends with os._exit: its tensor-parallel ranks are stopped here
    return 0

