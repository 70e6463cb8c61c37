"""The stream channel (serve_app.stream_channel): replicas' chunks to the router outside Ray's calls.

The ends are tested here in one event loop (no Ray); the serving tests run every stream of the demo app and of
the two-replica app (kills, migrations, drains, deadlines, disconnects) through the channel, and the
prefix-affinity app through Serve's calls alone.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading

import httpx
import pytest

from inflight.serve_app import stream_channel
from inflight.serve_app.messages import (Choice, Chunk, Draining, Finished, GenerateRequest, ReplicaStats, Route,
                                         Started, to_plain)
from inflight.serve_app.replica_streams import ChannelStream, LinkStream, ReplicaDraining
from inflight.serve_app.stream_channel import StreamInbox, StreamOutbox, pack_frame
from tests.serving.helpers import completion_body, get_stats, parse_sse, post_stream, wait_for_stats

pytestmark = pytest.mark.timeout(60, func_only=True)


def _chunk(text: str, finished: bool = False) -> Chunk | Finished:
    choices = (Choice(0, text, [1, 2], logprobs=[{"token": "a", "logprob": -0.5, "top": [("a", -0.5)]}]),)
    return Finished(choices) if finished else Chunk(choices)


def _request(prompt: str | list[int]) -> GenerateRequest:
    return GenerateRequest("cmpl-test", "completion", {}, prompt=prompt)


async def _started_inbox() -> StreamInbox:
    inbox = StreamInbox("127.0.0.1")
    await inbox.start()
    return inbox


def _hold_steps_after(engine, steps: int) -> threading.Event:
    """Let ``engine`` (an ``LLMEngine``, stepped on its own thread) take ``steps`` more steps; the next one waits
    until the event returned is set."""
    real_step, release, left = engine.core_step, threading.Event(), [steps]

    def step(*args, **kwargs):
        if left[0]:
            left[0] -= 1
        else:
            release.wait(60.0)
        return real_step(*args, **kwargs)

    engine.core_step = step
    return release


async def _wait_until(predicate, timeout_s: float = 10.0) -> bool:
    """Whether ``predicate()`` came true within ``timeout_s`` (checked between turns of the loop): a bound for a busy
    machine, not a measure of speed."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


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
            connection.send(route_a.key, _chunk(f"a{i}"))
            connection.send(route_b.key, _chunk(f"b{i}"))
        await connection.drain()
        got_a = [await asyncio.wait_for(queue_a.get(), 5) for _ in range(3)]
        got_b = [await asyncio.wait_for(queue_b.get(), 5) for _ in range(3)]
        await inbox.stop()
        return got_a, got_b

    got_a, got_b = asyncio.run(main())
    assert [c.choices[0].text for c in got_a] == ["a0", "a1", "a2"]
    assert [c.choices[0].text for c in got_b] == ["b0", "b1", "b2"]
    assert got_a[0].choices[0].logprobs[0]["top"] == [["a", -0.5]]  # msgpack: pairs come back as lists
    assert len(frames) == 1 and len(frames[0]) == 6


def test_a_chunk_goes_out_in_the_turn_it_was_sent_without_waiting_for_the_stream_to_end():
    async def main():
        inbox = await _started_inbox()
        route, queue = inbox.open()
        connection = StreamOutbox().connection(route)
        await connection.drain()  # connected
        connection.send(route.key, _chunk("now"))  # no drain: the replica drains only at a stream's end
        got = await asyncio.wait_for(queue.get(), 2)
        await inbox.stop()
        return got

    assert asyncio.run(main()).choices[0].text == "now"


def test_a_closed_stream_gets_nothing_and_the_others_go_on():
    async def main():
        inbox = await _started_inbox()
        (route_a, queue_a), (route_b, queue_b) = inbox.open(), inbox.open()
        inbox.close(route_a)  # cancelled: a late replica's chunks for it are dropped
        connection = StreamOutbox().connection(route_b)
        connection.send(route_a.key, _chunk("late"))
        connection.send(route_b.key, _chunk("kept", finished=True))
        await connection.drain()
        got = await asyncio.wait_for(queue_b.get(), 5)
        await asyncio.sleep(0.05)
        inbox.close(route_b)
        await inbox.stop()
        return got, queue_a.qsize(), inbox.num_open

    got, late, num_open = asyncio.run(main())
    assert got.choices[0].text == "kept" and got.finished
    assert late == 0 and num_open == 0


def test_a_connection_without_the_secret_is_closed_and_delivers_nothing():
    async def main():
        inbox = await _started_inbox()
        route, queue = inbox.open()
        reader, writer = await asyncio.open_connection("127.0.0.1", inbox.port)
        writer.write(pack_frame("not the secret") + pack_frame([[route.key, to_plain(_chunk("forged"))]]))
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
    async def send(inbox: StreamInbox, route: Route) -> bool:
        """With the secret, then a length beyond MAX_FRAME_BYTES: the router hangs up rather than buffer it."""
        reader, writer = await asyncio.open_connection("127.0.0.1", inbox.port)
        writer.write(pack_frame({"secret": inbox.secret, "replica_id": "r"})
                     + struct.pack(">I", stream_channel.MAX_FRAME_BYTES + 1))
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
                first.send(route.key, _chunk("x" * 100_000))
                await first.drain()
                await asyncio.sleep(0.02)
        assert first.broken
        second_inbox = await _started_inbox()  # e.g. the same router listening again: a fresh connection
        route2, queue2 = second_inbox.open()
        second = outbox.connection(route2)
        assert second is not first and len(outbox) == 1  # the broken connection was forgotten
        second.send(route2.key, _chunk("again"))
        await second.drain()
        got = await asyncio.wait_for(queue2.get(), 5)
        await second_inbox.stop()
        return got

    assert asyncio.run(main()).choices[0].text == "again"


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

    def remote(self, request: GenerateRequest) -> _Call:
        self.calls.append(_Call())
        return self.calls[-1]


def test_the_router_cancels_a_call_only_while_its_request_can_still_run():

    async def main():
        inbox = await _started_inbox()
        replicas = _Replicas()
        done, running, ended = (ChannelStream(replicas, inbox, _request([1])) for _ in range(3))
        connection = StreamOutbox().connection(done.route)
        connection.send(done.route.key, _chunk("last", finished=True))
        await connection.drain()
        assert (await asyncio.wait_for(done.__anext__(), 5)).finished
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
    hung_up = False
    try:
        stranger.sendall(pack_frame({"secret": "guess", "replica_id": "x"})
                         + pack_frame([[key, to_plain(_chunk("forged"))] for key in range(1, 10_000)]))
    except (ConnectionResetError, BrokenPipeError):  # the router hung up before the kernel had taken it all
        hung_up = True
    with httpx.Client(timeout=60) as client:
        response, stream = post_stream(client, "/v1/completions", completion_body(max_tokens=24, ignore_eos=True))
    assert response.status_code == 200
    assert stream.done and stream.text() and "forged" not in stream.raw
    try:  # the router hung up on it (a reset: it left the forged frames unread)
        hung_up = hung_up or stranger.recv(1) == b""
    except ConnectionResetError:
        hung_up = True
    assert hung_up
    stranger.close()
    # Every stream the router opened (this module's and the earlier tests' on this app: disconnects, timeouts,
    # errors) is closed again; any whose reader never came back, at the latest 10 s after its call ended.
    wait_for_stats(lambda s: s["router"]["stream_channel"]["open_streams"] == 0, base_url=server, timeout=15.0)


# -- requests down a replica's connection (no Serve call) ----------------------------------------------------------
class _FakeReplica:
    """A replica's end as ``LLMReplica`` wires it: requests come down, each answered by ``answer(request)``'s
    messages (one per turn of the loop, so that an abort can come between them)."""

    def __init__(self, replica_id: str, answer) -> None:
        self.answer = answer
        self.aborted: list[int] = []
        self.outbox = StreamOutbox(replica_id, on_frame=self.on_frame, on_close=self.on_close)

    def on_frame(self, connection, op, payload) -> None:
        if op == stream_channel.GENERATE:
            key = payload.route.key
            connection.tasks[key] = asyncio.ensure_future(self.run(connection, key, payload))
        else:
            connection.tasks[payload].cancel()

    def on_close(self, connection) -> None:
        for task in connection.tasks.values():
            task.cancel()

    async def run(self, connection, key, request) -> None:
        try:
            for message in self.answer(request):
                connection.send(key, message)
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            self.aborted.append(key)
            raise


async def _linked(inbox: StreamInbox, replica: _FakeReplica):
    """The replica connected to the inbox (as ``LLMReplica.connect`` does when the router introduces itself)."""
    connection = replica.outbox.connection(inbox.address)
    await connection.drain()
    if await _wait_until(lambda: replica.outbox.replica_id in inbox.links):
        return inbox.links[replica.outbox.replica_id], connection
    raise AssertionError("the replica never showed up among the router's links")


def test_a_request_sent_down_a_link_streams_back_and_an_abort_stops_it_there():

    def answer(request):
        for i in range(1000):
            yield _chunk(f"{request.prompt}{i}")

    async def main():
        inbox = await _started_inbox()
        replica = _FakeReplica("r1", answer)
        link, _ = await _linked(inbox, replica)
        stream = LinkStream(link, inbox, _request("p"))
        got = [(await asyncio.wait_for(stream.__anext__(), 5)).choices[0].text for _ in range(3)]
        in_flight = len(link.keys)
        stream.cancel()
        await _wait_until(lambda: replica.aborted)
        await inbox.stop()
        return got, in_flight, replica.aborted, stream.route.key, len(link.keys)

    got, in_flight, aborted, key, left = asyncio.run(main())
    assert got == ["p0", "p1", "p2"]
    assert in_flight == 1 and left == 0  # the link's in-flight count, which routing reads, is back to 0
    assert aborted == [key]


def test_a_reader_cancelled_while_it_waits_for_the_next_message_still_aborts_the_request_there():
    """A client gone mid-stream cancels the router's reader wherever it is: often while it waits for the replica's
    next message (``__anext__``, which closes the stream's route when it fails). The request must still be aborted
    on the replica, not left generating to its last token with nobody reading."""

    class _Busy(_FakeReplica):  # one message, then a long computation before the next
        async def run(self, connection, key, request) -> None:
            try:
                connection.send(key, _chunk("first"))
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                self.aborted.append(key)
                raise

    async def main():
        inbox = await _started_inbox()
        replica = _Busy("r1", None)
        link, _ = await _linked(inbox, replica)
        stream = LinkStream(link, inbox, _request("p"))
        await asyncio.wait_for(stream.__anext__(), 5)
        reader = asyncio.ensure_future(stream.__anext__())  # waits: the replica sends nothing for a while
        await asyncio.sleep(0.05)
        reader.cancel()  # the client left
        with pytest.raises(asyncio.CancelledError):
            await reader
        stream.cancel()  # what the router's ``_chunks`` does on its way out
        await _wait_until(lambda: replica.aborted)
        aborted = list(replica.aborted)  # before the inbox stops: closing the connection would cancel it anyway
        await inbox.stop()
        return aborted, stream.route.key, len(link.keys)

    aborted, key, left = asyncio.run(main())
    assert aborted == [key], "the abandoned request was not aborted on the replica"
    assert left == 0


def test_a_link_lost_ends_its_streams_with_stream_lost_and_is_no_longer_routable():

    async def main():
        inbox = await _started_inbox()
        replica = _FakeReplica("r1", lambda request: iter([_chunk("first")]))  # and then the replica is gone
        link, connection = await _linked(inbox, replica)
        stream = LinkStream(link, inbox, _request("p"))
        first = await asyncio.wait_for(stream.__anext__(), 5)
        connection.writer.close()  # the replica's process dies: the kernel closes its sockets
        with pytest.raises(stream_channel.StreamLost):
            await asyncio.wait_for(stream.__anext__(), 5)
        routable = inbox.routable_links()
        await inbox.stop()
        return first, routable, inbox.num_open

    first, routable, num_open = asyncio.run(main())
    assert first.choices[0].text == "first"
    assert routable == [] and num_open == 0


def test_a_silent_link_is_lost_and_a_draining_one_takes_no_new_request():

    async def main():
        inbox = await _started_inbox()
        quiet = _FakeReplica("quiet", lambda request: iter(()))  # takes the request, never answers
        draining = _FakeReplica("draining", lambda request: iter([Draining()]))
        quiet_link, _ = await _linked(inbox, quiet)
        draining_link, draining_connection = await _linked(inbox, draining)
        draining_connection.send(stream_channel.NEWS_KEY, ReplicaStats(num_running=3, time=1.0))
        await draining_connection.drain()
        stream = LinkStream(quiet_link, inbox, _request("p"))
        refused = LinkStream(draining_link, inbox, _request("p"))  # sent before the news came
        with pytest.raises(ReplicaDraining):
            await asyncio.wait_for(refused.__anext__(), 5)
        stats = draining_link.stats
        draining_connection.send(stream_channel.NEWS_KEY, Draining())
        await draining_connection.drain()
        await asyncio.sleep(0.1)
        routable = sorted(link.replica_id for link in inbox.routable_links())
        inbox.check_silence(now=quiet_link.last_heard + stream_channel.SILENCE_S - 1)  # not yet
        still = sorted(inbox.links)
        inbox.check_silence(now=quiet_link.last_heard + stream_channel.SILENCE_S + 1)
        with pytest.raises(stream_channel.StreamLost):
            await asyncio.wait_for(stream.__anext__(), 5)
        await inbox.stop()
        return stats, routable, still, sorted(inbox.links)

    stats, routable, still, left = asyncio.run(main())
    assert stats == ReplicaStats(num_running=3, time=1.0)
    assert routable == ["quiet"]  # connected still (its requests finish), but nothing new goes to it
    assert still == ["draining", "quiet"]
    assert "quiet" not in left


def test_once_its_replica_is_connected_a_request_goes_down_the_connection_not_through_serve(server):
    """The router introduces itself to the replica; from then on requests skip Serve's call (``requests_sent``), and
    a client that leaves mid-stream still frees the request in the engine (the abort goes down the connection)."""
    replica_id = get_stats(server)["replicas"][0]["replica_id"]
    channel = wait_for_stats(lambda s: replica_id in s["router"]["stream_channel"]["routable_replicas"],
                             base_url=server, timeout=15.0, what="the replica connected")["router"]["stream_channel"]
    assert channel["serve_replicas"] == channel["connected_replicas"] == [replica_id], str(channel)
    before = channel["requests_sent"]
    with httpx.Client(timeout=60) as client:
        for i in range(4):
            response, stream = post_stream(client, "/v1/completions", completion_body(f"down {i}", max_tokens=4))
            assert response.status_code == 200 and stream.done
        with client.stream("POST", f"{server}/v1/completions",
                           json=completion_body("leaves", max_tokens=2000, ignore_eos=True, stream=True)) as left:
            next(left.iter_lines())  # one event, then the client is gone
    after = wait_for_stats(lambda s: s["replicas"][0]["num_running"] == 0, base_url=server, timeout=15.0,
                           what="the abandoned request aborted")["router"]["stream_channel"]["requests_sent"]
    assert after["connection"] - before["connection"] == 5
    assert after["serve_call"] == before["serve_call"]


def test_a_real_replica_serves_requests_down_its_connection_aborts_them_and_drains_before_it_stops():
    """``LLMReplica`` in this process (demo-tiny, no Serve) connected to a router's inbox: a request sent down the
    connection streams back whole; an abort frees its batch slot; when Serve stops the replica (``__del__``) the
    router hears it is draining, a request sent anyway is refused as such (the router sends it elsewhere), and the
    stop waits until the request already running has finished."""
    from inflight.serve_app.replica import LLMReplica

    def request(request_id: str, max_tokens: int) -> GenerateRequest:
        return GenerateRequest(request_id, "completion", {"max_tokens": max_tokens, "temperature": 0,
                                                          "ignore_eos": True}, prompt="Hello")

    async def read_all(stream) -> list:
        return [message async for message in stream]

    async def main():
        replica = LLMReplica("demo-tiny", {"max_model_len": 256, "num_threads": 1})
        inbox = await _started_inbox()
        release = None
        try:
            assert await replica.connect(inbox.address) == replica.replica_id
            assert await _wait_until(inbox.routable_links), "the replica never connected"
            link = inbox.links[replica.replica_id]
            whole = await read_all(LinkStream(link, inbox, request("whole", 12)))

            aborted = LinkStream(link, inbox, request("aborted", 200))
            await asyncio.wait_for(aborted.__anext__(), 10)
            aborted.cancel()
            await _wait_until(lambda: replica.engine.stats()["num_running"] == 0)
            running_after_abort = replica.engine.stats()["num_running"]

            # Two steps for "running" (its first token and one more), then the engine waits for ``release``: the
            # request is still running when the stop is checked, however fast or slow the machine.
            release = _hold_steps_after(replica.engine.engine, 2)
            running_stream = LinkStream(link, inbox, request("running", 200))
            first = await asyncio.wait_for(running_stream.__anext__(), 10)  # it runs: now Serve stops the replica
            running = asyncio.ensure_future(read_all(running_stream))
            stopping = asyncio.ensure_future(replica.__del__())
            await _wait_until(lambda: not inbox.routable_links())  # the router hears of the drain
            routable_while_draining = inbox.routable_links()
            with pytest.raises(ReplicaDraining):
                await asyncio.wait_for(LinkStream(link, inbox, request("late", 4)).__anext__(), 10)
            stopped_before_it_finished = stopping.done()
            release.set()
            finished = [first] + await asyncio.wait_for(running, 60)
            await asyncio.wait_for(stopping, 10)
            return whole, running_after_abort, routable_while_draining, stopped_before_it_finished, finished
        finally:
            if release is not None:
                release.set()
            await inbox.stop()
            await replica.engine.shutdown()

    whole, running_after_abort, routable, stopped_early, finished = asyncio.run(main())
    assert isinstance(whole[0], Started) and whole[-1].finished
    assert sum(len(m.choices[0].token_ids) for m in whole) == 12
    assert running_after_abort == 0
    assert routable == [] and not stopped_early
    assert finished[-1].finished and sum(len(m.choices[0].token_ids) for m in finished) == 200


@pytest.mark.timeout(180, func_only=True)
def test_two_routers_each_send_requests_down_a_connection_of_their_own(ray_cluster):
    """``router_replicas: 2`` (Serve's proxy spreads clients over them): the replica keeps a connection to each, and
    concurrent streams through both routers all come back whole."""
    from tests.serving.apps import delete_app, deploy_app

    args = {"model": "demo-tiny", "engine_args": {"max_model_len": 512, "max_num_seqs": 8, "num_threads": 1},
            "num_cpus_per_replica": 0.5, "router_replicas": 2, "default_timeout_s": 60}
    base = deploy_app(args, name="two-routers", route_prefix="/two-routers")
    try:
        wait_for_stats(lambda s: s["replicas"][0]["router_connections"] == 2, base_url=base, timeout=30.0,
                       what="the replica connected to both routers")

        async def run() -> list:
            async with httpx.AsyncClient(timeout=60.0) as client:
                async def one(i: int):
                    body = completion_body(f"two routers {i}", max_tokens=16, ignore_eos=True, stream=True,
                                           stream_options={"include_usage": True})
                    async with client.stream("POST", base + "/v1/completions", json=body) as response:
                        return response.status_code, (await response.aread()).decode()
                return await asyncio.gather(*(one(i) for i in range(12)))

        for status, raw in asyncio.run(run()):
            assert status == 200, raw
            stream = parse_sse(raw)
            assert stream.done and not stream.errors and stream.usage["completion_tokens"] == 16
    finally:
        delete_app("two-routers")


def test_a_message_that_cannot_be_packed_closes_the_connection_and_numpy_numbers_go_as_numbers():
    """A numpy scalar (a stat, a logprob) is sent as the number it is; anything else msgpack cannot pack is a bug,
    and the connection is closed at once, so the router treats its requests as lost (and continues them) rather
    than waiting for messages that will never come."""
    import numpy as np

    scored = Chunk((Choice(0, "n", [1], logprobs=[{"token": "n", "logprob": np.float32(0.5), "top": []}]),))
    answers = iter([[scored], [Chunk((Choice(0, object(), [1]),))]])

    async def main():
        inbox = await _started_inbox()
        replica = _FakeReplica("r1", lambda request: next(answers))
        link, _ = await _linked(inbox, replica)
        fine = LinkStream(link, inbox, _request("a"))
        got = await asyncio.wait_for(fine.__anext__(), 5)
        broken = LinkStream(link, inbox, _request("b"))
        with pytest.raises(stream_channel.StreamLost):
            await asyncio.wait_for(broken.__anext__(), 5)
        await inbox.stop()
        return got, inbox.routable_links()

    got, routable = asyncio.run(main())
    logprob = got.choices[0].logprobs[0]["logprob"]
    assert logprob == 0.5 and type(logprob) is float
    assert routable == []


def test_a_serve_call_stream_counts_on_its_replicas_link_once_its_first_message_names_the_replica():
    """A request that went as a Serve call (no connection covered every replica yet) is counted on its replica's
    link from its first message on, so routing down connections sees everything that replica holds."""

    async def main():
        inbox = await _started_inbox()
        replica = _FakeReplica("r1", lambda request: iter(()))
        link, connection = await _linked(inbox, replica)
        replicas = _Replicas()
        stream = ChannelStream(replicas, inbox, _request([1]))
        before = len(link.keys)
        connection.send(stream.route.key, Started("r1", 1, _chunk("first").choices))
        await asyncio.wait_for(stream.__anext__(), 5)
        counted = len(link.keys)
        connection.send(stream.route.key, _chunk("last", finished=True))
        await asyncio.wait_for(stream.__anext__(), 5)
        await inbox.stop()
        return before, counted, len(link.keys)

    assert asyncio.run(main()) == (0, 1, 0)
