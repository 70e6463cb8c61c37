"""Tokens from a replica to a router outside Ray's actor calls: one TCP connection per (replica, router).

Why: every item of a Ray Serve streaming call is a Ray task-return message, and on a small machine each costs
the replica and the router about a millisecond of CPU between them (Ray's per-message machinery was ~60% of a
replica's samples and ~40% of a router's at 64 streams), on the cores the engine needs; and the first token
pays a Ray hop back. So the request still goes through the Serve handle (the request router picks the replica;
Serve keeps its in-flight count, backpressure and cancellation, and a dead replica still fails the call), but
that call's own stream carries only the acknowledgement and its end; the chunks travel here, in msgpack frames,
the chunks of every stream that has one ready in the same turn of the replica's event loop in one write.

The router listens (``StreamInbox``) on its node's address with a random secret; each request carries a
``route`` (address, secret, and a key for this attempt). A replica connects on its first stream to that
router (``StreamOutbox``), says the secret, then sends ``[[key, chunk], ...]`` frames. Frames for a key the
router no longer expects (a cancelled or superseded attempt) are dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import struct
from typing import Any

import msgpack

logger = logging.getLogger("ray.serve")

_LENGTH = struct.Struct(">I")
MAX_FRAME_BYTES = 256 * 1024 * 1024  # a frame larger than this is a broken or hostile peer


def pack_frame(obj: Any) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return _LENGTH.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader) -> Any:
    (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if size > MAX_FRAME_BYTES:
        raise ConnectionError(f"frame of {size} bytes refused")
    return msgpack.unpackb(await reader.readexactly(size), raw=False, strict_map_key=False)


class StreamInbox:
    """The router's end: a listening socket, and a queue per expected stream (``open``/``close`` by key)."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.port: int | None = None
        self.secret = secrets.token_hex(16)
        self._queues: dict[int, asyncio.Queue] = {}
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

    def open(self) -> tuple[dict[str, Any], asyncio.Queue]:
        """A new stream: (the route a replica sends it by, the queue its chunks arrive in)."""
        key = next(self._keys)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[key] = queue
        return {"host": self.host, "port": self.port, "secret": self.secret, "key": key}, queue

    def close(self, route: dict[str, Any]) -> None:
        self._queues.pop(route["key"], None)

    @property
    def num_open(self) -> int:
        return len(self._queues)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._connections):
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        try:
            if await read_frame(reader) != self.secret:
                logger.warning("stream channel: a connection without the secret was closed")
                return
            queues = self._queues
            while True:
                for key, chunk in await read_frame(reader):
                    queue = queues.get(key)
                    if queue is not None:
                        queue.put_nowait(chunk)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, msgpack.UnpackException):
            pass  # the replica went away (its streams' handle calls say so) or sent garbage
        finally:
            self._connections.discard(writer)
            writer.close()


class _Connection:
    """One replica -> router connection: chunks sent in one turn of the event loop go in one frame."""

    def __init__(self, host: str, port: int, secret: str) -> None:
        self.pending: list[list] = []
        self.writer: asyncio.StreamWriter | None = None
        self.error: BaseException | None = None
        self.opened = asyncio.ensure_future(self._open(host, port, secret))

    async def _open(self, host: str, port: int, secret: str) -> None:
        try:
            _, self.writer = await asyncio.open_connection(host, port)
            self.writer.write(pack_frame(secret))
            self._flush()
        except OSError as e:
            self.error = e
            raise

    def send(self, key: int, chunk: dict[str, Any]) -> None:
        if self.error is not None:
            raise ConnectionError(f"stream channel to the router is broken: {self.error!r}")
        self.pending.append([key, chunk])
        if len(self.pending) == 1 and self.writer is not None:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        if not self.pending or self.writer is None:
            return
        frame, self.pending = pack_frame(self.pending), []
        try:
            self.writer.write(frame)
        except Exception as e:  # the router went away
            self.error = e

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

    @property
    def broken(self) -> bool:
        return self.error is not None or (self.writer is not None and self.writer.is_closing())


class StreamOutbox:
    """The replica's end: a connection per router, opened on the first stream to it, replaced when broken."""

    def __init__(self) -> None:
        self._connections: dict[tuple[str, int, str], _Connection] = {}

    def connection(self, route: dict[str, Any]) -> _Connection:
        where = (route["host"], route["port"], route["secret"])
        connection = self._connections.get(where)
        if connection is None or connection.broken:
            # routers come and go (redeploys, restarts): forget the connections to those that went
            for gone in [w for w, c in self._connections.items() if c.broken]:
                del self._connections[gone]
            connection = self._connections[where] = _Connection(*where)
        return connection

    def __len__(self) -> int:
        return len(self._connections)
