"""Requests and tokens between routers and replicas outside Ray's calls: one TCP connection per (replica, router).

Why: a Ray Serve call costs a request about 3.7 ms of hops and ~2 ms of CPU in the router and the replica
(Serve's router, gRPC, the replica's request wrapper), and every item of a streaming call is a Ray message of its
own; on a small machine that is the cores the engine needs (the gap between serving and offline throughput was
mostly this, `docs/benchmarks-history.md`, issue 13). So once a replica is connected, the router sends it requests
(and aborts) down the connection and the replica sends the chunks back up it, in msgpack frames: whatever one
side has ready in one turn of its event loop goes in one write.

Serve still owns the replicas: which exist (the router ``broadcast``s its address to every replica Serve knows,
``LLMReplica.connect``, once a second), their health, their draining and their lifecycle; a request goes through a
plain Serve call when no connection can take it (none made yet, or every connected replica draining or full), and
that call's replica then connects. How the router learns a replica is gone: its connection closes (its process
died: the kernel closes its sockets), it says it is draining (Serve is stopping it; it finishes what it runs), or
nothing came on it for ``SILENCE_S`` (a node gone without a word); every request it carried then continues
elsewhere (the router's migration).

The router listens (``StreamInbox``) on its node's address with a random secret. A replica connects
(``StreamOutbox``), says the secret and its replica id, then sends ``[[key, message], ...]`` frames: key 0 for
its own news (its ``ReplicaStats`` every ``routing_stats_period_s``, at most ``HEARTBEAT_S``, which are also its
load for routing; ``Draining``), other keys for one request's messages (``serve_app.messages``). The router sends
``[[op, payload], ...]``: ``["generate", request]`` (a ``GenerateRequest``, whose route names its key) and
``["abort", key]``. Messages travel in their plain form (``messages.to_plain``), converted here at both ends:
the callers on either side see typed messages only. Messages for a key the router no longer expects are dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import struct
import time
from typing import Any, Callable

import msgpack
import msgspec

from inflight.serve_app.messages import Draining, GenerateRequest, Message, ReplicaStats, Route, from_plain, to_plain

logger = logging.getLogger("ray.serve")

_LENGTH = struct.Struct(">I")
MAX_FRAME_BYTES = 256 * 1024 * 1024  # a frame larger than this is a broken or hostile peer
NEWS_KEY = 0  # a replica's messages about itself, not about a request
HEARTBEAT_S = 0.5  # a replica's stats on each connection, at least this often
SILENCE_S = 10.0  # a connection nothing came on for this long is lost


def pack_frame(obj: Any) -> bytes:
    """A frame of builtins (messages in their plain form: ``messages.to_plain``)."""
    body = msgpack.packb(obj, use_bin_type=True)
    return _LENGTH.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> Any:
    (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if size > MAX_FRAME_BYTES:
        raise ConnectionError(f"frame of {size} bytes refused")
    return msgpack.unpackb(await reader.readexactly(size), raw=False, strict_map_key=False)


_READ_ERRORS = (asyncio.IncompleteReadError, ConnectionError, ValueError, TypeError, msgpack.UnpackException)
GENERATE, ABORT = "generate", "abort"  # the router's ops


class StreamLost(ConnectionError):
    """A replica's messages stopped: its connection closed or fell silent, or its call ended without them."""


class End:
    """In a stream's queue after its messages: how it ended (an error, or a last message of the Serve call's own)."""
    __slots__ = ("error", "message")

    def __init__(self, error: BaseException | None, message: Message | None = None) -> None:
        self.error, self.message = error, message


class _Writer:
    """Frames out on one connection: what is sent in one turn of the event loop goes in one write."""

    def __init__(self) -> None:
        self.writer: asyncio.StreamWriter | None = None
        self.error: BaseException | None = None
        self.pending: list[list] = []

    def _queue(self, item: list) -> None:
        if self.error is not None:
            raise ConnectionError(f"stream channel connection is broken: {self.error!r}")
        self.pending.append(item)
        if len(self.pending) == 1 and self.writer is not None:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        if not self.pending or self.writer is None:
            return
        pending, self.pending = self.pending, []
        try:  # messages in their plain form, here: a message that cannot be (a bug) breaks this connection only
            self.writer.write(pack_frame([[head, to_plain(body) if isinstance(body, msgspec.Struct) else body]
                                          for head, body in pending]))
        except TypeError as e:  # a message that cannot be sent (a bug): the connection goes, and the other end
            # hears it at once (a lost replica's requests continue elsewhere) rather than waiting for words never sent
            logger.exception("stream channel: a message could not be packed; closing the connection")
            self.error = e
            self.writer.close()
        except Exception as e:  # the other end went away
            self.error = e

    @property
    def broken(self) -> bool:
        return self.error is not None or (self.writer is not None and self.writer.is_closing())


class ReplicaLink(_Writer):
    """The router's end of one replica's connection: requests go down it, their chunks and the replica's news
    come up it."""

    def __init__(self, replica_id: str, writer: asyncio.StreamWriter) -> None:
        super().__init__()
        self.replica_id = replica_id
        self.writer = writer
        self.keys: set[int] = set()  # requests sent on it and not yet closed: its in-flight count
        self.stats: ReplicaStats | None = None  # the replica's latest report
        self.draining = False
        self.closed = False
        self.last_heard = time.monotonic()

    @property
    def routable(self) -> bool:
        return not (self.closed or self.draining or self.broken)

    def generate(self, request: GenerateRequest) -> None:
        self._queue([GENERATE, request])

    def abort(self, key: int) -> None:
        if not self.broken:
            self._queue([ABORT, key])


class StreamInbox:
    """The router's end: a listening socket, the replicas connected to it (``links``), and a queue per expected
    stream (``open``/``close`` by key)."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.port: int | None = None
        self.secret = secrets.token_hex(16)
        self.links: dict[str, ReplicaLink] = {}  # by replica id
        self._queues: dict[int, asyncio.Queue] = {}
        self._link_of: dict[int, ReplicaLink] = {}
        self._keys = itertools.count(1)
        self._server: asyncio.base_events.Server | None = None
        self._starting: asyncio.Future | None = None
        self._connections: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        """Listen (once; concurrent callers wait for the same start)."""
        if self._starting is None:
            self._starting = asyncio.ensure_future(asyncio.start_server(self._serve, self.host, 0))
        self._server = await asyncio.shield(self._starting)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def address(self) -> Route:
        """Where a replica connects (what ``LLMReplica.connect`` is told; a request's ``route`` adds its key)."""
        return Route(self.host, self.port, self.secret, NEWS_KEY)

    def open(self, link: ReplicaLink | None = None) -> tuple[Route, asyncio.Queue]:
        """A new stream: (the route a replica sends it by, the queue its messages arrive in); ``link``: the
        connection it is sent on, whose loss ends it."""
        key = next(self._keys)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[key] = queue
        if link is not None:
            self._link_of[key] = link
            link.keys.add(key)
        return Route(self.host, self.port, self.secret, key), queue

    def attach(self, route: Route, replica_id: str) -> None:
        """A stream opened for a Serve call, now that its replica is known (its first message says): counted on
        that replica's link like the requests sent down it (routing sees every request a replica holds), and
        ended with the link if the link is lost."""
        key = route.key
        link = self.links.get(replica_id)
        if link is not None and not link.closed and key in self._queues and key not in self._link_of:
            self._link_of[key] = link
            link.keys.add(key)

    def close(self, route: Route) -> None:
        key = route.key
        self._queues.pop(key, None)
        link = self._link_of.pop(key, None)
        if link is not None:
            link.keys.discard(key)

    @property
    def num_open(self) -> int:
        return len(self._queues)

    def routable_links(self) -> list[ReplicaLink]:
        return [link for link in self.links.values() if link.routable]

    def check_silence(self, now: float | None = None) -> None:
        """Drop the connections nothing came on for ``SILENCE_S`` (their replica's node is gone without a word)."""
        now = time.monotonic() if now is None else now
        for link in list(self.links.values()):
            if now - link.last_heard > SILENCE_S:
                logger.warning("stream channel: nothing from replica %s for %.0f s: taken as lost", link.replica_id,
                               now - link.last_heard)
                link.writer.close()
                self._lose(link, "its replica fell silent")

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._connections):
            writer.close()

    def _lose(self, link: ReplicaLink, why: str) -> None:
        """The link is gone: every request still on it ends with ``StreamLost`` (the router continues it)."""
        if link.closed:
            return
        link.closed = True
        if self.links.get(link.replica_id) is link:
            del self.links[link.replica_id]
        for key in list(link.keys):
            queue = self._queues.get(key)
            if queue is not None:
                queue.put_nowait(End(StreamLost(why)))
        link.keys.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        link: ReplicaLink | None = None
        try:
            hello = await read_frame(reader)
            if not isinstance(hello, dict) or hello.get("secret") != self.secret:
                logger.warning("stream channel: a connection without the secret was closed")
                return
            link = ReplicaLink(str(hello.get("replica_id")), writer)
            previous = self.links.get(link.replica_id)
            if previous is not None:  # the replica reconnected: what was on the old connection is lost
                self._lose(previous, "its replica's connection was replaced")
            self.links[link.replica_id] = link
            queues = self._queues
            while True:
                frame = await read_frame(reader)
                link.last_heard = time.monotonic()
                for key, message in frame:
                    if key == NEWS_KEY:
                        self._news(link, from_plain(message))
                        continue
                    queue = queues.get(key)
                    if queue is not None:
                        queue.put_nowait(from_plain(message))
        except _READ_ERRORS:
            pass  # the replica went away, or sent garbage
        finally:
            self._connections.discard(writer)
            writer.close()
            if link is not None:
                self._lose(link, "its replica's connection to this router was cut")

    @staticmethod
    def _news(link: ReplicaLink, news: Message) -> None:
        if type(news) is ReplicaStats:
            link.stats = news
        elif type(news) is Draining:
            link.draining = True


class ReplicaConnection(_Writer):
    """The replica's end of one connection to a router: messages go up it (``send``), requests come down it
    (``on_frame`` gets each ``(op, payload)``: a ``GenerateRequest``, or the key to abort)."""

    def __init__(self, address: Route, replica_id: str,
                 on_frame: Callable[["ReplicaConnection", str, Any], None] | None,
                 on_close: Callable[["ReplicaConnection"], None] | None) -> None:
        super().__init__()
        self.tasks: dict[int, asyncio.Task] = {}  # the requests that came on it, by key (the replica's to fill)
        self._on_frame, self._on_close = on_frame, on_close
        self.opened = asyncio.ensure_future(self._open(address.host, address.port, address.secret, replica_id))

    async def _open(self, host: str, port: int, secret: str, replica_id: str) -> None:
        try:
            reader, self.writer = await asyncio.open_connection(host, port)
            self.writer.write(pack_frame({"secret": secret, "replica_id": replica_id}))
            self._flush()
        except OSError as e:
            self.error = e
            raise
        self._reading = asyncio.ensure_future(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                frame = await read_frame(reader)
                if self._on_frame is not None:
                    for op, payload in frame:
                        self._on_frame(self, op, from_plain(payload) if op == GENERATE else payload)
        except _READ_ERRORS as e:
            self.error = self.error or e
        finally:
            self.writer.close()
            if self._on_close is not None:
                self._on_close(self)

    def send(self, key: int, message: Message) -> None:
        self._queue([key, message])

    async def drain(self) -> None:
        """Until everything sent so far is handed to the socket (the stream's end may then be reported)."""
        await self.opened
        self._flush()
        if self.error is not None:
            raise ConnectionError(f"stream channel to the router is broken: {self.error!r}")
        try:
            await self.writer.drain()
        except Exception as e:
            self.error = e
            raise ConnectionError(f"stream channel to the router is broken: {e!r}") from None


class StreamOutbox:
    """The replica's end: a connection per router, opened when the router first introduces itself or sends a
    request through Serve, replaced when broken."""

    def __init__(self, replica_id: str = "local",
                 on_frame: Callable[[ReplicaConnection, str, Any], None] | None = None,
                 on_close: Callable[[ReplicaConnection], None] | None = None,
                 greeting: Callable[[], Message] | None = None) -> None:
        """``greeting``: the news a new connection carries first (the replica's stats, so that the router ranks it
        with the others from the start rather than a heartbeat later)."""
        self.replica_id = replica_id
        self._on_frame, self._on_close, self._greeting = on_frame, on_close, greeting
        self._connections: dict[tuple[str, int, str], ReplicaConnection] = {}

    def connection(self, route: Route) -> ReplicaConnection:
        where = (route.host, route.port, route.secret)
        connection = self._connections.get(where)
        if connection is None or connection.broken:
            # routers come and go (redeploys, restarts): forget the connections to those that went
            for gone in [w for w, c in self._connections.items() if c.broken]:
                del self._connections[gone]
            connection = self._connections[where] = ReplicaConnection(route, self.replica_id, self._on_frame,
                                                                      self._on_close)
            if self._greeting is not None:
                connection.send(NEWS_KEY, self._greeting())
        return connection

    def tell_all(self, news: Message) -> None:
        """``news`` (stats, draining) to every router connected."""
        for connection in self._connections.values():
            if connection.writer is not None and not connection.broken:
                connection.send(NEWS_KEY, news)

    def connections(self) -> list[ReplicaConnection]:
        return list(self._connections.values())

    def __len__(self) -> int:
        return len(self._connections)
