"""The stream channel (serve_app.stream_channel): replicas' chunks to the router outside Ray's calls.

The ends are tested here in one event loop (no Ray); the serving tests run every stream of the demo app and of
the two-replica app (kills, migrations, drains, deadlines, disconnects) through the channel, and the
prefix-affinity app through Serve's calls alone.
"""

from __future__ import annotations

import asyncio
import socket
import struct

import httpx
import pytest

from serve_app import stream_channel
from serve_app.stream_channel import StreamInbox, StreamOutbox, pack_frame
from tests.serving.helpers import completion_body, get_stats, post_stream, wait_for_stats

pytestmark = pytest.mark.timeout(60, func_only=True)


def _chunk(text: str, finished: bool = False) -> dict:
    return {"choices": [{"index": 0, "text": text, "token_ids": [1, 2], "finish_reason": None,
                         "stop_reason": None, "logprobs": [{"token": "a", "logprob": -0.5, "top": [("a", -0.5)]}]}],
            "finished": finished}


async def _started_inbox() -> StreamInbox:
    inbox = StreamInbox("127.0.0.1")
    await inbox.start()
    return inbox


def test_chunks_reach_their_streams_in_order_and_one_turn_makes_one_frame(monkeypatch):
    frames = []
    pack = stream_channel.pack_frame
    monkeypatch.setattr(stream_channel, "pack_frame", lambda obj: frames.append(obj) or pack(obj))

    async def main():
        inbox = await _started_inbox()
        (route_a, queue_a), (route_b, queue_b) = inbox.open(), inbox.open()
        connection = StreamOutbox().connection(route_a)
        await connection.drain()  # connected and said the secret
        frames.clear()
        for i in range(3):  # one turn of the loop: both streams' chunks
            connection.send(route_a["key"], _chunk(f"a{i}"))
            connection.send(route_b["key"], _chunk(f"b{i}"))
        await connection.drain()
        got_a = [await asyncio.wait_for(queue_a.get(), 5) for _ in range(3)]
        got_b = [await asyncio.wait_for(queue_b.get(), 5) for _ in range(3)]
        await inbox.stop()
        return got_a, got_b

    got_a, got_b = asyncio.run(main())
    assert [c["choices"][0]["text"] for c in got_a] == ["a0", "a1", "a2"]
    assert [c["choices"][0]["text"] for c in got_b] == ["b0", "b1", "b2"]
    assert got_a[0]["choices"][0]["logprobs"][0]["top"] == [["a", -0.5]]  # msgpack: pairs come back as lists
    assert len(frames) == 1 and len(frames[0]) == 6


def test_a_chunk_goes_out_in_the_turn_it_was_sent_without_waiting_for_the_stream_to_end():
    async def main():
        inbox = await _started_inbox()
        route, queue = inbox.open()
        connection = StreamOutbox().connection(route)
        await connection.drain()  # connected
        connection.send(route["key"], _chunk("now"))  # no drain: the replica drains only at a stream's end
        got = await asyncio.wait_for(queue.get(), 2)
        await inbox.stop()
        return got

    assert asyncio.run(main())["choices"][0]["text"] == "now"


def test_a_closed_stream_gets_nothing_and_the_others_go_on():
    async def main():
        inbox = await _started_inbox()
        (route_a, queue_a), (route_b, queue_b) = inbox.open(), inbox.open()
        inbox.close(route_a)  # cancelled: a late replica's chunks for it are dropped
        connection = StreamOutbox().connection(route_b)
        connection.send(route_a["key"], _chunk("late"))
        connection.send(route_b["key"], _chunk("kept", finished=True))
        await connection.drain()
        got = await asyncio.wait_for(queue_b.get(), 5)
        await asyncio.sleep(0.05)
        inbox.close(route_b)
        await inbox.stop()
        return got, queue_a.qsize(), inbox.num_open

    got, late, num_open = asyncio.run(main())
    assert got["choices"][0]["text"] == "kept" and got["finished"]
    assert late == 0 and num_open == 0


def test_a_connection_without_the_secret_is_closed_and_delivers_nothing():
    async def main():
        inbox = await _started_inbox()
        route, queue = inbox.open()
        reader, writer = await asyncio.open_connection("127.0.0.1", inbox.port)
        writer.write(pack_frame("not the secret") + pack_frame([[route["key"], _chunk("forged")]]))
        await writer.drain()
        closed = await asyncio.wait_for(reader.read(), 5) == b""  # the router hung up
        forged = await asyncio.wait_for(OversizedFrame.send(inbox, route), 5)
        await inbox.stop()
        return closed, queue.qsize(), forged

    closed, delivered, oversized_closed = asyncio.run(main())
    assert closed and delivered == 0
    assert oversized_closed


class OversizedFrame:
    @staticmethod
    async def send(inbox: StreamInbox, route: dict) -> bool:
        """With the secret, then a length beyond MAX_FRAME_BYTES: the router hangs up rather than buffer it."""
        reader, writer = await asyncio.open_connection("127.0.0.1", inbox.port)
        writer.write(pack_frame(inbox.secret) + struct.pack(">I", stream_channel.MAX_FRAME_BYTES + 1))
        await writer.drain()
        return await reader.read() == b""


def test_a_replica_whose_router_is_gone_fails_its_stream_and_reconnects_for_the_next():
    async def main():
        inbox = await _started_inbox()
        route, _ = inbox.open()
        outbox = StreamOutbox()
        first = outbox.connection(route)
        await first.drain()
        await inbox.stop()  # the router's process went away: its connections are closed
        with pytest.raises(ConnectionError):
            for _ in range(50):  # the close reaches the replica's side within a few sends
                first.send(route["key"], _chunk("x" * 100_000))
                await first.drain()
                await asyncio.sleep(0.02)
        assert first.broken
        second_inbox = await _started_inbox()  # e.g. the same router listening again: a fresh connection
        route2, queue2 = second_inbox.open()
        second = outbox.connection(route2)
        assert second is not first and len(outbox) == 1  # the broken connection was forgotten
        second.send(route2["key"], _chunk("again"))
        await second.drain()
        got = await asyncio.wait_for(queue2.get(), 5)
        await second_inbox.stop()
        return got

    assert asyncio.run(main())["choices"][0]["text"] == "again"


class _Call:
    """What ``replicas.generate.remote`` returns, reduced to what the router's stream uses: its end and cancel."""

    def __init__(self) -> None:
        self.cancels = 0
        self.ended = asyncio.Event()

    def cancel(self) -> None:
        self.cancels += 1

    async def __anext__(self):
        await self.ended.wait()
        raise StopAsyncIteration


class _Replicas:
    def __init__(self) -> None:
        self.calls: list[_Call] = []
        self.generate = self

    def remote(self, request: dict) -> _Call:
        self.calls.append(_Call())
        return self.calls[-1]


def test_the_router_cancels_a_call_only_while_its_request_can_still_run():
    from serve_app.router import _ChannelStream

    async def main():
        inbox = await _started_inbox()
        replicas = _Replicas()
        done, running, ended = (_ChannelStream(replicas, inbox, {"prompt": [1]}) for _ in range(3))
        connection = StreamOutbox().connection(done.route)
        connection.send(done.route["key"], _chunk("last", finished=True))
        await connection.drain()
        assert (await asyncio.wait_for(done.__anext__(), 5))["finished"]
        replicas.calls[2].ended.set()  # a call that ended before its messages were read
        await asyncio.sleep(0.01)
        for stream in (done, running, ended):  # as the router does when a response ends, however it ends
            stream.cancel()
        await inbox.stop()
        return [call.cancels for call in replicas.calls], inbox.num_open

    cancels, num_open = asyncio.run(main())
    assert cancels == [0, 1, 0]  # only the request that may still be running in an engine is aborted
    assert num_open == 0


# -- through the server ----------------------------------------------------------------------------------------
def test_the_server_streams_through_the_channel_and_a_stranger_cannot_speak_on_it(server):
    with httpx.Client(timeout=60) as client:  # the router listens from its first request on
        assert post_stream(client, "/v1/completions", completion_body(max_tokens=2))[0].status_code == 200
    channel = get_stats(server)["router"]["stream_channel"]
    assert channel is not None and channel["port"]
    # A stranger connects to the router's channel port and forges chunks for the first keys.
    stranger = socket.create_connection((channel["host"], channel["port"]), timeout=5)
    stranger.sendall(pack_frame("guess") + pack_frame([[key, _chunk("forged")] for key in range(1, 10_000)]))
    with httpx.Client(timeout=60) as client:
        response, stream = post_stream(client, "/v1/completions", completion_body(max_tokens=24, ignore_eos=True))
    assert response.status_code == 200
    assert stream.done and stream.text() and "forged" not in stream.raw
    try:  # the router hung up on it (a reset: it left the forged frames unread)
        hung_up = stranger.recv(1) == b""
    except ConnectionResetError:
        hung_up = True
    assert hung_up
    stranger.close()
    # Every stream the router opened (this module's and the earlier tests' on this app: disconnects, timeouts,
    # errors) is closed again; any whose reader never came back, at the latest 10 s after its call ended.
    wait_for_stats(lambda s: s["router"]["stream_channel"]["open_streams"] == 0, base_url=server, timeout=15.0)
