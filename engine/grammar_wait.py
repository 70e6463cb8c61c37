"""Requests waiting for their structured output's grammar, compiled on a pool thread so that the step loop never
waits for a compile: a request joins the queue once its grammar is ready, the batch goes on meanwhile.

A grammar that fails to compile here (the server checked it when the request was made, so this is rare) ends its
request as aborted, as does an abort while it waits.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from inflight.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class GrammarWait:
    def __init__(self, constraints: Any) -> None:
        self._constraints = constraints  # the sampler's constraints (structured_output.Constraints): their compile
        self._pool: ThreadPoolExecutor | None = None  # started with the first structured request
        self._compiling: list[tuple[Future, list[Request]]] = []
        self._aborted: list[list[Request]] = []

    def __bool__(self) -> bool:
        """Anything to look at before the next step."""
        return bool(self._compiling or self._aborted)

    def add(self, requests: list[Request], constraint: Any) -> None:
        """A request's sequences, waiting for ``constraint``'s grammar."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="inflight-grammar")
        self._compiling.append((self._pool.submit(self._constraints.compile, constraint), requests))

    def abort(self, request_id: str) -> bool:
        """Abort request ``request_id`` if it waits here (it ends with the next ``take``); whether it did."""
        for entry in self._compiling:
            if entry[1][0].parent_id == request_id:
                self._compiling.remove(entry)
                self._aborted.append(entry[1])
                return True
        return False

    def take(self, idle: bool) -> tuple[list[list[Request]], list[str]]:
        """The requests whose grammar is ready (to queue), and the ids of those that ended here (their sequences
        marked finished, aborted). ``idle``: the engine has nothing else to do, so wait a little, not spin."""
        ready, ended, waiting = [], [], []
        for future, requests in self._compiling:
            if not future.done():
                waiting.append((future, requests))
            elif future.exception() is not None:
                logger.warning("structured output of request %s failed to compile: %s", requests[0].parent_id,
                               future.exception())
                ended.append(_end(requests))
            else:
                ready.append(requests)
        self._compiling = waiting
        ended.extend(_end(requests) for requests in self._aborted)
        self._aborted = []
        if waiting and idle:
            wait([f for f, _ in waiting], timeout=0.002, return_when=FIRST_COMPLETED)
        return ready, ended


def _end(requests: list[Request]) -> str:
    for request in requests:
        request.status, request.finish_reason = RequestStatus.FINISHED, "abort"
        request.metrics.finished_time = time.time()
    return requests[0].parent_id
