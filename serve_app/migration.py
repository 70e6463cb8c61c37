"""A request whose replica is lost mid-stream continues on another one, from what the client was sent.

``Progress`` keeps, per choice, what was relayed (token ids, text length, whether it ended); ``messages``
relays one prompt's messages and, when the replica goes (dies, is drained), opens the request again elsewhere
with ``continue_from``, at most ``max_migrations`` times: exactly, nothing repeated or missing (greedy and
seeded choices go on as they would have; text held back for stop strings is still held).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import msgspec

from inflight.serve_app.errors import RequestTimeoutError, ServerError
from inflight.serve_app.messages import Continued, GenerateRequest, StreamEvent
from inflight.serve_app.replica_client import DEADLINE_GRACE_S, ReplicaClient
from inflight.serve_app.replica_streams import REPLICA_GONE, lost_reason

logger = logging.getLogger("ray.serve")


class ReplicaLost(Exception):
    """The replicas serving a request went away more often than ``max_migrations``: it cannot be continued."""


class Progress:
    """What the client has been sent of one prompt's choices (the replicas' messages as relayed): per choice its
    token ids, the length of its text and whether it ended. Enough to continue the request on another replica
    exactly (``continued``): the engine counts those tokens as output, holds back what was held back, and a
    sampled choice draws what it would have drawn (its seed's draws depend on the output position only)."""

    def __init__(self, n: int) -> None:
        self.token_ids: list[list[int]] = [[] for _ in range(n)]
        self.text_len = [0] * n
        self.ended = [False] * n

    def add(self, message: StreamEvent) -> None:
        for choice in message.choices:
            i = choice.index
            self.token_ids[i].extend(choice.token_ids)
            self.text_len[i] += len(choice.text) - choice.num_echoed_chars  # the generated text's characters
            self.ended[i] = self.ended[i] or choice.finish_reason is not None

    @property
    def finished(self) -> bool:
        return all(self.ended)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    def continued(self, request: GenerateRequest, migration: int) -> GenerateRequest:
        """``request`` continued from here: its unfinished choices, from what the client has; the prompt's
        echo and prompt logprobs were sent already."""
        params = {k: v for k, v in request.params.items() if k != "prompt_logprobs"}
        continue_from = tuple(Continued(i, list(self.token_ids[i]), self.text_len[i])
                              for i in range(len(self.ended)) if not self.ended[i])
        # Not refused as unmeetable: it was admitted once; its deadline still ends it.
        return msgspec.structs.replace(request, request_id=f"{request.request_id}-m{migration}", params=params,
                                       echo=False, client_timeout=False, continue_from=continue_from)


async def messages(client: ReplicaClient, request: GenerateRequest, deadline: float, max_migrations: int,
                   metrics) -> AsyncIterator[StreamEvent]:
    """The replica's messages for one prompt. A replica lost mid-request is not the client's problem: the
    request continues on another replica from the tokens relayed so far (``Progress``), at most
    ``max_migrations`` times; a replica lost before it answered is retried (``ReplicaClient``)."""
    stream, first = await client.open(request, deadline)
    progress = Progress(request.params.get("n", 1))
    progress.add(first)
    migrations = 0
    try:
        # Inside the try: a consumer that leaves after the first message (a client gone before the body
        # started) must still cancel the request, when it closes this generator or drops it.
        yield first
        while True:
            try:
                # (asyncio.timeout, not wait_for: on 3.11 wait_for wraps every message's wait in a task of its own)
                async with asyncio.timeout(max(0.001, deadline + DEADLINE_GRACE_S - time.monotonic())):
                    message = await stream.__anext__()
            except StopAsyncIteration:
                return
            except REPLICA_GONE as e:
                if progress.finished:  # lost after its last tokens were relayed: nothing is missing
                    return
                if migrations >= max_migrations:
                    raise ReplicaLost(f"the response was cut off after {progress.num_tokens} tokens because "
                                      f"{lost_reason(e)}, {migrations} times; send the request again") from None
                migrations += 1
                metrics.migrations.inc(tags={"reason": "replica_lost"})
                logger.warning("request %s: replica lost after %d tokens (%r); continuing it on another replica "
                               "(migration %d)", request.request_id, progress.num_tokens, e, migrations)
                stream, message = await client.open(progress.continued(request, migrations), deadline)
            except asyncio.TimeoutError:
                metrics.timeouts.inc()  # the router's own deadline guard fired, not the engine's
                raise RequestTimeoutError("request timed out", code="timeout") from None
            except asyncio.CancelledError:
                raise
            except Exception as e:
                logger.exception("replica failed during request %s", request.request_id)
                raise ServerError(f"replica failed: {type(e).__name__}") from None
            progress.add(message)
            yield message
    finally:
        stream.cancel()  # a no-op when finished; aborts the engine request when we leave early
