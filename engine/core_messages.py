"""What crosses between the engine's core (its step loop, on a thread or in a process of its own) and its caller.

Typed values, not tuples: the caller sends commands (``AddRequests``, ``AbortRequest``, ``FinishStopped``,
``StopLoop``); the core answers with a ``StepReport`` per step, whose records are a ``SequenceUpdate`` per
sequence that got tokens or ended, or one ``PlainStep`` for a step in which every row got exactly one token and
nothing else (the usual decode step: one object to build, pickle and read for all its rows). A core in a process
of its own also starts with ``CoreStart`` and answers ``CoreReady`` or ``CoreFailed``, and ``CoreDied`` if its loop
fails.

msgspec structs, frozen and positional (``array_like``): as cheap to build as a tuple (a ``SequenceUpdate`` is made
per row of every general step) and a few times cheaper to pickle than a dataclass.
"""

from __future__ import annotations

from typing import Any

import msgspec


class _Message(msgspec.Struct, frozen=True, array_like=True, gc=False):
    pass


# -- commands, caller -> core -----------------------------------------------------------------------------------
class AddRequests(_Message):
    """A request's sequences (all ``n``), fresh from ``RequestMaker`` (in no scheduler yet). ``seq`` numbers the
    add commands: reports say up to which one the core has taken in (``StepReport.applied_seq``)."""

    seq: int
    requests: list  # list[engine.request.Request]


class AbortRequest(_Message):
    request_id: str


class FinishStopped(_Message):
    """The front end found a stop string in sequence ``request_id``: end it in the core."""

    request_id: str
    stop: str


class StopLoop(_Message):
    pass


Command = AddRequests | AbortRequest | FinishStopped | StopLoop


# -- records, core -> caller ------------------------------------------------------------------------------------
class CoreMetrics(_Message):
    """``RequestMetrics``' fields after ``arrival_time``, in a request's first sequence's first and last record."""

    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int
    predicted_ttft_s: float | None


class SequenceUpdate(_Message):
    """What one sequence got in a step: its new token ids, and its end, raw logprobs of the new tokens, raw prompt
    logprobs (in its first record), its embedding (in its last), the request's metrics, when there are any. A
    request reported only at its end (final-only, no stop strings) has one record."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    embedding: list[float] | None = None
    metrics: CoreMetrics | None = None


class PlainStep(_Message):
    """A step of the persistent batch in which every row got one token and nothing else: the rows' sequence ids
    and their new token, in row order."""

    request_ids: list[str]
    token_ids: list[int]


Record = SequenceUpdate | PlainStep


class Refusal(_Message):
    """A request the core refused at admission (a bad argument, a deadline it cannot meet)."""

    request_id: str
    error: Exception


class StepReport(_Message):
    """The core's report after a step (or, with no step, after commands that changed something)."""

    records: list = []  # list[Record], for the caller's front end
    refused: list = []  # list[Refusal]
    seconds: float | None = None  # the step's wall time (None: no step ran)
    batch_size: int = 0
    stats: dict[str, Any] | None = None
    view: Any = None  # ttft_predictor.QueueView
    applied_seq: int = 0  # every add command up to this one is in stats and view


# -- a core process's start and end -----------------------------------------------------------------------------
class CoreStart(_Message):
    model: str
    engine_args: dict[str, Any]
    cpus: set[int] | None


class CoreReady(_Message):
    config: Any  # engine.config.EngineConfig
    max_model_len: int
    max_model_len_note: str | None
    stats: dict[str, Any]


class CoreFailed(_Message):
    """The engine could not be built: ``ValueError`` (a bad argument) or another error, by name, and its message."""

    error_type: str
    message: str


class CoreDied(_Message):
    """The core's loop failed; ``reason`` is the error's repr (it crosses the process boundary as text)."""

    reason: str
