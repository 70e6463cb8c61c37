"""``PerRequestState``: what the sampler keeps for a request across steps (penalty counts, a grammar matcher),
by sequence id, until the scheduler reports the request ended (``SchedulerOutput.ended_ids``)."""

from __future__ import annotations

from typing import Generic, TypeVar

State = TypeVar("State")


class PerRequestState(Generic[State]):
    def __init__(self) -> None:
        self._states: dict[str, State] = {}

    def __len__(self) -> int:
        return len(self._states)

    def forget(self, request_ids: list[str]) -> None:
        """Requests that ended: their state is not needed again."""
        for request_id in request_ids:
            self._states.pop(request_id, None)
