"""What the engine hands back: plain data, safe to pass across threads and processes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "timeout"]


class DeadlineUnmeetableError(Exception):
    """Refused at admission: the predicted time to first token is past the request's deadline.

    Not a ``ValueError``: the request is fine, the engine is busy. Servers answer 429 with
    ``Retry-After: retry_after_s`` (when the work ahead should have drained enough)."""

    def __init__(self, message: str, predicted_ttft_s: float, retry_after_s: float) -> None:
        super().__init__(message)
        self.predicted_ttft_s = predicted_ttft_s
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # it crosses from the engine's process to the server's
        return type(self), (str(self), self.predicted_ttft_s, self.retry_after_s)


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of a request's life; None until it happens."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    predicted_ttft_s: float | None = None  # the admission-time prediction (None before the predictor is ready)


@dataclass
class CompletionOutput:
    """One of the ``n`` sequences of a request.

    ``token_ids`` and ``text`` are everything so far; ``new_token_ids`` and ``new_text`` are what
    this step added (what a streaming client sends on). With ``output_kind="delta"`` ``token_ids``, ``text``
    and ``logprobs`` hold only what is new too (one list each, no copy of what came before).
    """

    index: int
    token_ids: list[int]
    text: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state after a step. ``prompt_logprobs`` (asked for with ``SamplingParams.prompt_logprobs``):
    one entry per prompt position, None at position 0, complete in every output after the prompt is computed.
    ``embedding`` (an embedding request, ``PoolingParams``): the mean over the prompt's positions of the
    final-norm hidden state, in the finished output. With ``output_kind="delta"`` the prompt's fields
    (``prompt_token_ids``, ``prompt_logprobs``) come in a request's first output only, None in later ones."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    embedding: list[float] | None = None
