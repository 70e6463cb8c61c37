"""One attempt of a request on a replica, as the router reads it: the transports behind ``ReplicaClient``.

Three, each an async iterator of the replica's ``messages`` with ``cancel`` (which stops the request where it
runs), each kept because it pays or because the others need it (``docs/design.md``, "Tokens travel outside
Serve's calls"):

- ``LinkStream``: the request goes down the replica's own connection to this router and its messages come up it
  (``serve_app.stream_channel``): no Serve call at all, the measured fast path.
- ``ChannelStream``: a Serve call carrying a ``Route``, its messages still coming up the connection. The fallback
  while no connection covers every replica Serve runs (a replica just started or reconnecting, all draining or
  full): Serve reaches every replica, and the replica it picks then connects.
- ``ServeCallStream``: a plain Serve streaming call whose items are the messages (``stream_channel: false``).

A stream ends with its last message (``finished``: ``Finished``, a finished ``Started``, ``Refused``), or with the
error that says its replica is gone (``REPLICA_GONE``: the router retries or migrates the request).
"""

from __future__ import annotations

import asyncio

import msgspec
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from inflight.serve_app.errors import EngineLost
from inflight.serve_app.messages import Draining, Failed, GenerateRequest, Lost, Started, StreamEvent
from inflight.serve_app.stream_channel import End, ReplicaLink, StreamInbox, StreamLost

CHANNEL_GRACE_S = 10.0  # a replica's call ended but its last chunks have not come this long after: lost


class ReplicaDraining(ConnectionError):
    """A request sent on a replica's connection just as Serve began stopping that replica: it goes elsewhere."""


class ReplicaFailed(RuntimeError):
    """A replica's request failed with an error of the replica's own (a bug): a 500 for the client."""


REPLICA_GONE = (RayActorError, ActorDiedError, ActorUnavailableError, StreamLost, EngineLost, ReplicaDraining)


def lost_reason(error: BaseException) -> str:
    """What a client is told about a lost replica: the kind of failure, not Ray's repr (RPC codes, raw ids)."""
    if isinstance(error, StreamLost):
        return "its replica's connection to this router was cut"
    if isinstance(error, ActorUnavailableError):
        return "its replica became unreachable (its process or node went away)"
    if isinstance(error, EngineLost):
        return "its replica's engine died"
    if isinstance(error, ReplicaDraining):
        return "its replica was being stopped"
    return "its replica died (its process or node went away)"


async def _end_of(response):
    try:
        return await response.__anext__()
    except StopAsyncIteration:
        return None


class ServeCallStream:
    """A plain Serve streaming call: its items are the messages; cancelling it aborts the request in the engine."""

    def __init__(self, replicas: DeploymentHandle, request: GenerateRequest) -> None:
        self.response = replicas.generate.remote(request)

    def __aiter__(self) -> "ServeCallStream":
        return self

    async def __anext__(self) -> StreamEvent:
        return await self.response.__anext__()

    def cancel(self) -> None:
        self.response.cancel()


class _InboxStream:
    """One attempt's messages as they arrive in the router's inbox (``serve_app.stream_channel``): the stream ends
    with the message that says the request finished or was refused, or with the error that ends ``_next``.
    ``cancel`` (each kind's own) stops the request where it runs."""

    inbox: StreamInbox
    route: object
    finished: bool

    def __aiter__(self) -> "_InboxStream":
        return self

    async def __anext__(self) -> StreamEvent:
        if self.finished:
            raise StopAsyncIteration
        try:
            message = await self._next()
        except asyncio.CancelledError:  # the reader left (its client, a deadline) while the request may still run:
            self.cancel()  # abort it there now; closing the route first would leave ``cancel`` nothing to abort
            raise
        except BaseException:  # the stream ended (its replica lost, or refused it): nothing runs there any more
            self.inbox.close(self.route)
            raise
        if message.finished:
            self.finished = True
            self.inbox.close(self.route)
        return message

    async def _next(self) -> StreamEvent:
        raise NotImplementedError

    def cancel(self) -> None:
        raise NotImplementedError


class ChannelStream(_InboxStream):
    """One attempt's messages when they come on the stream channel after a Serve call.

    The Serve call is made as without the channel, with the route added; it yields nothing, and ends when
    the replica has sent the request's last message, or fails when the replica is lost: that end is queued
    behind the messages it followed. ``cancel`` cancels the call (which aborts the request in the engine),
    as for a plain call's generator."""

    def __init__(self, replicas: DeploymentHandle, inbox: StreamInbox, request: GenerateRequest) -> None:
        self.inbox = inbox
        self.route, self.queue = inbox.open()
        self.response = replicas.generate.remote(msgspec.structs.replace(request, route=self.route))
        self.end = asyncio.ensure_future(_end_of(self.response))
        self.end.add_done_callback(self._on_end)
        self.call_ended = False
        self.finished = False

    async def _next(self) -> StreamEvent:
        item = await (asyncio.wait_for(self.queue.get(), CHANNEL_GRACE_S) if self.call_ended else self.queue.get())
        if type(item) is not End:
            if type(item) is Started:  # the first message: which replica Serve picked
                self.inbox.attach(self.route, item.replica_id)
            return item
        if item.error is not None:
            raise item.error
        if item.message is not None:  # an item of the call itself (a replica sends all on the channel)
            return item.message
        self.call_ended = True  # its messages were sent before it ended: they are here or close behind
        try:
            return await asyncio.wait_for(self.queue.get(), CHANNEL_GRACE_S)
        except asyncio.TimeoutError:
            raise StreamLost("the replica's last tokens never arrived") from None

    def _on_end(self, end: asyncio.Future) -> None:
        if end.cancelled():  # by ``cancel``, or by Serve with the request that made the call (its client left)
            self.queue.put_nowait(End(asyncio.CancelledError(), None))  # a reader still waiting stops
        else:
            error = end.exception()
            self.queue.put_nowait(End(error, None if error is not None else end.result()))
        # Nothing is sent after the call ends; what was sent comes within the grace. So the inbox forgets this
        # stream by then even if its reader never comes back (it keeps its queue and what is in it).
        asyncio.get_running_loop().call_later(CHANNEL_GRACE_S, self.inbox.close, self.route)

    def cancel(self) -> None:
        # A call that has ended, or whose replica has sent the request's last message, has nothing left to
        # abort: its end comes by itself. Cancelling it anyway is a Ray cancel per request (~3% of a router's
        # CPU at 64 streams) that does nothing.
        if not self.finished and not self.end.done():
            self.response.cancel()
            self.end.cancel()
        self.inbox.close(self.route)


class LinkStream(_InboxStream):
    """One attempt's messages when the request itself went down a replica's connection (``ReplicaLink``): no Serve
    call at all. The connection's loss (closed, or silent) ends it with ``StreamLost`` behind the messages that
    came; ``cancel`` sends an abort, which leaves the stream in the engine (freeing its KV blocks)."""

    def __init__(self, link: ReplicaLink, inbox: StreamInbox, request: GenerateRequest) -> None:
        self.link, self.inbox = link, inbox
        self.route, self.queue = inbox.open(link)
        link.generate(msgspec.structs.replace(request, route=self.route))
        self.finished = False

    async def _next(self) -> StreamEvent:
        message = await self.queue.get()
        kind = type(message)
        if kind is End:
            raise message.error
        # How the request ended on the replica, when that was not a last message:
        if kind is Lost:
            raise EngineLost(message.reason)
        if kind is Draining:
            raise ReplicaDraining("its replica is being stopped")
        if kind is Failed:
            raise ReplicaFailed(message.error_type)
        return message

    def cancel(self) -> None:
        if not self.finished and self.route.key in self.link.keys:  # still running there
            self.link.abort(self.route.key)
        self.inbox.close(self.route)
