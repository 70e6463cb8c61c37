"""The engine core's messages (engine/core_messages.py): every type survives the trip to the engine's process."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from inflight.engine import SamplingParams
from inflight.engine.config import EngineConfig
from inflight.engine.core_messages import (AbortRequest, AddRequests, CoreDied, CoreFailed, CoreMetrics, CoreReady,
                                           CoreStart, FinishStopped, PlainStep, Refusal, SequenceUpdate, StepReport,
                                           StopLoop)
from inflight.engine.engine_core import run_step_loop
from inflight.engine.outputs import DeadlineUnmeetableError
from inflight.engine.request import Request
from inflight.engine.ttft_predictor import QueueView


def _request() -> Request:
    return Request("r-1", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0), max_model_len=64,
                   eos_token_ids=frozenset({2}), prompt="hi")


def _messages() -> list[msgspec.Struct]:
    metrics = CoreMetrics(1.5, 2.5, None, 1, 0.25)
    update = SequenceUpdate("r-1", [9, 10], "stop", "###", [((9, -0.5, 1), [(9, -0.5)])], [None, ((6, -1.0, 2), [])],
                            [0.1, 0.2], metrics)
    return [
        AddRequests(3, [_request()]), AbortRequest("r-1"), FinishStopped("r-1", "###"), StopLoop(),
        metrics, update, SequenceUpdate("r-2", [11]), PlainStep(["a", "b"], [1, 2]),
        Refusal("r-3", ValueError("max_tokens: too many")),
        StepReport([update, PlainStep(["a"], [3])], [Refusal("r-4", DeadlineUnmeetableError("late", 1.0, 2.0))], 0.02, 2,
                   {"num_running": 2}, None, 3),
        CoreStart("demo-tiny", {"max_num_seqs": 4}, {0, 1}), CoreStart("demo-tiny", {}, None),
        CoreReady(EngineConfig(), 128, None, {"num_running": 0}), CoreFailed("ValueError", "max_num_seqs: must be >= 1"),
        CoreDied("RuntimeError('boom')"),
    ]


def _same(a, b) -> bool:
    """Structs equal field by field; an exception, a request, by type and what it says (they define no equality)."""
    if isinstance(a, msgspec.Struct):
        return type(a) is type(b) and all(_same(getattr(a, f), getattr(b, f)) for f in a.__struct_fields__)
    if isinstance(a, BaseException):
        return type(a) is type(b) and a.args == b.args
    if isinstance(a, Request):
        return (a.request_id, a.all_token_ids, a.params, a.max_total_tokens) == \
            (b.request_id, b.all_token_ids, b.params, b.max_total_tokens)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


@pytest.mark.parametrize("message", _messages(), ids=lambda m: type(m).__name__)
def test_each_message_round_trips_through_pickle(message):
    copy = pickle.loads(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
    assert _same(message, copy)
    if message.__struct_fields__:
        with pytest.raises(AttributeError):  # frozen: a message is a value once sent
            setattr(message, message.__struct_fields__[0], None)


def test_every_message_type_is_exercised():
    import inflight.engine.core_messages as module

    defined = {v for v in vars(module).values()
               if isinstance(v, type) and issubclass(v, msgspec.Struct) and not v.__name__.startswith("_")}
    assert defined == {type(m) for m in _messages()}


def test_the_step_loop_refuses_what_is_not_a_command():
    class NoEngine:
        def has_unfinished_requests(self):
            return False

        def check_ranks(self):
            pass

    with pytest.raises(TypeError, match="not an engine core command"):
        run_step_loop(NoEngine(), lambda wait: [("abort", "r-1")], lambda report: None)


def test_a_queue_view_crosses_in_a_report():
    report = StepReport(view=QueueView.__new__(QueueView))
    assert type(pickle.loads(pickle.dumps(report)).view) is QueueView
