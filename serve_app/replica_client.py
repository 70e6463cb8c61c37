"""``ReplicaClient``: the router's one way to its replicas. It starts a request on a replica and awaits the first
answer, retrying on another replica one that was lost before it answered; it picks the transport
(``serve_app.replica_streams``) and, for requests down the replicas' connections, the replica.

How it knows which replicas Serve runs: each introduction round (every ``INTRODUCE_PERIOD_S``) broadcasts this
router's address to the replicas through Serve's handle (``LLMReplica.connect``), and the replicas that answer
with their id are the live set (/stats' broadcast adds any it finds first). A broadcast reaches exactly the
replicas Serve routes to now, so no registry shared with Serve's request router is needed: a replica Serve stops
is no longer reached (and one draining answers None), a new one is reached and connects, within a round. Requests go down connections only while those cover the live set; else through Serve,
whose request router (``request_router.LLMRequestRouter``) ranks by the same policy (``routing.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import msgspec
from ray.serve.handle import DeploymentHandle

from inflight.serve_app.config import RouterConfig
from inflight.serve_app.errors import APIError, RequestTimeoutError, ServerError, ServiceUnavailableError
from inflight.serve_app.messages import EmbedRequest, Embeddings, GenerateRequest, Refused
from inflight.serve_app.replica_streams import (REPLICA_GONE, ChannelStream, LinkStream, ServeCallStream,
                                                lost_reason)
from inflight.serve_app.routing import RoutingPolicy
from inflight.serve_app.stream_channel import ReplicaLink, StreamInbox

logger = logging.getLogger("ray.serve")

DEADLINE_GRACE_S = 2.0  # the engine ends a late request itself; the router steps in only after this
INTRODUCE_PERIOD_S = 1.0  # how often a router tells every replica where to connect (serve_app.stream_channel)
MIN_INTRODUCE_PERIOD_S = 0.2  # ... and at most this often, when a replica it should route to is not connected


class ReplicaClient:
    """Requests to one deployment's replicas: ``open`` (a stream of a generate request's messages, after its
    first answer) and ``embed``; ``inbox`` is None with ``stream_channel: false`` (every request a Serve call)."""

    def __init__(self, replicas: DeploymentHandle, config: RouterConfig, metrics, host: str) -> None:
        self.streaming = replicas.options(stream=True)
        self.control = replicas  # unary calls: embed, tokenize, stats, ping, connect
        self.config = config
        self.metrics = metrics
        self.inbox = StreamInbox(host) if config.stream_channel else None
        # Requests sent down replicas' connections are routed here, by the same policies as Serve's calls.
        self.link_policy = RoutingPolicy(config.routing_policy)
        self.live: frozenset[str] = frozenset()  # the replicas that answered the last introduction round
        self.requests_sent = {"connection": 0, "serve_call": 0}  # how attempts went (/stats)
        self._introduce_now = asyncio.Event()
        self._introductions: asyncio.Task | None = None

    # -- a request's start -------------------------------------------------------------------------
    async def open(self, request: GenerateRequest, deadline: float):
        """Start ``request`` on some replica; returns (its messages, an async iterator with ``cancel``; the first)."""
        if self.inbox is not None:
            await self.inbox.start()
            self.start_introductions()

        def stream(attempt: GenerateRequest):
            if self.inbox is None:
                chunks = ServeCallStream(self.streaming, attempt)
            else:
                link = self._pick_link(attempt)
                self.requests_sent["serve_call" if link is None else "connection"] += 1
                chunks = (LinkStream(link, self.inbox, attempt) if link is not None
                          else ChannelStream(self.streaming, self.inbox, attempt))
            return chunks, chunks.__anext__()

        return await self._first_answer(request, deadline, stream)

    async def embed(self, request: EmbedRequest, deadline: float) -> Embeddings:
        """One ``LLMReplica.embed`` call for all of a request's inputs (retried like a stream's start)."""
        def unary(attempt: EmbedRequest):
            response = self.control.embed.remote(attempt)
            return response, response

        _, result = await self._first_answer(request, deadline, unary)
        return result

    async def _first_answer(self, request: GenerateRequest | EmbedRequest, deadline: float, call):
        """Send ``request`` to a replica and await its first answer; returns (the call's response, that answer).

        ``call(request)`` makes the call and returns (response, awaitable of its first answer): a stream's first
        message, or a unary call's result. A replica lost before it answered is replaced by another (bounded by
        ``max_attempts``): nothing has reached the client yet. Every other failure cancels the call, which aborts
        the request in the engine. A refusal (``Refused``) is raised as its ``APIError``."""
        last_error: BaseException | None = None
        for attempt in range(self.config.max_attempts):
            # only a client's own timeout may be refused as unmeetable; the server default is a net
            sent = msgspec.structs.replace(request, timeout_s=max(0.001, deadline - time.monotonic()),
                                           strict_deadline=request.client_timeout,
                                           request_id=f"{request.request_id}-retry{attempt}" if attempt
                                           else request.request_id)
            response, first_answer = call(sent)
            try:
                first = await asyncio.wait_for(first_answer, timeout=max(0.001, deadline + DEADLINE_GRACE_S
                                                                         - time.monotonic()))
            except REPLICA_GONE as e:
                last_error = e
                logger.warning("replica lost before request %s was answered (attempt %d): %r", request.request_id,
                               attempt + 1, e)
                await asyncio.sleep(min(1.0, 0.1 * 2 ** attempt))
                continue
            except asyncio.TimeoutError:
                response.cancel()
                self.metrics.timeouts.inc()  # the router's own deadline guard fired, not the engine's
                raise RequestTimeoutError("request timed out before the replica answered", code="timeout") from None
            except asyncio.CancelledError:
                response.cancel()
                raise
            except Exception as e:
                response.cancel()
                logger.exception("replica failed request %s", request.request_id)
                raise ServerError(f"replica failed: {type(e).__name__}") from None
            if type(first) is Refused:
                raise APIError.from_dict(first.error)
            return response, first
        reason = lost_reason(last_error) if last_error is not None else "no replica answered"
        raise ServiceUnavailableError(f"no replica could take the request in {self.config.max_attempts} attempts; "
                                      f"the last one failed because {reason}", code="replica_lost")

    # -- which replica, down which connection ------------------------------------------------------
    def _pick_link(self, request: GenerateRequest) -> ReplicaLink | None:
        """The connected replica to send ``request`` down, by the routing policy over each one's latest stats and
        this router's requests on it; None (a Serve call instead) when none is connected, or all are draining or
        at ``max_requests_per_replica``."""
        routable = self.inbox.routable_links()
        live = self.live
        if not live or not live <= {link.replica_id for link in routable}:
            # No replica known yet (the first round has not answered), or one Serve runs not connected (new,
            # reconnecting): Serve's call reaches every replica; and the replicas are introduced now rather than
            # at the next round.
            self._introduce_now.set()
            return None
        cap = self.config.max_requests_per_replica
        # Only replicas Serve still routes to: one it has begun to stop is told to drain a moment later.
        links = [link for link in routable if link.replica_id in live and len(link.keys) < cap]
        if not links:
            return None
        if len(links) == 1 and self.link_policy.policy != "prefix_affinity":
            return links[0]
        ranked = self.link_policy.choose([(link.replica_id, len(link.keys), link.stats) for link in links], request)
        return self.inbox.links[ranked[0]]

    # -- introductions -----------------------------------------------------------------------------
    def start_introductions(self) -> None:
        if self.inbox is not None and self._introductions is None:
            self._introductions = asyncio.ensure_future(self._introduce())

    async def _introduce(self) -> None:
        """Every ``INTRODUCE_PERIOD_S``: tell each replica Serve runs where to connect (a new one, one that lost
        its connection), learn from their answers which those are (``live``), and drop connections that fell
        silent."""
        await self.inbox.start()
        while True:
            if not self.live:
                # A call through the handle makes this process's request router for the replicas, which Serve then
                # keeps told of the replica set. (A broadcast alone does not.)
                try:
                    await asyncio.wait_for(self.control.ping.remote(), timeout=2.0)
                except Exception as e:  # replicas still starting: the next round asks again
                    logger.debug("no replica answered a ping: %r", e)
            try:
                answers = await asyncio.wait_for(self.control.broadcast("connect", self.inbox.address)
                                                 .results_async(return_exceptions=True), timeout=5.0)
                # A replica that failed to answer (dying) or is draining (None) is not routed to.
                self.live = frozenset(a for a in answers if isinstance(a, str))
            except Exception as e:  # no replica yet: the next round tries again
                logger.debug("introduction round failed: %r", e)
            self.inbox.check_silence()
            await asyncio.sleep(MIN_INTRODUCE_PERIOD_S)
            self._introduce_now.clear()
            try:
                await asyncio.wait_for(self._introduce_now.wait(), INTRODUCE_PERIOD_S - MIN_INTRODUCE_PERIOD_S)
            except asyncio.TimeoutError:
                pass

    def heard_from(self, replica_ids) -> None:
        """Replicas that answered another broadcast (/stats): Serve routes to them now too. One missing from the
        live set (Serve added it since the last round) is added and introduced at once, so that requests reach it
        through Serve until it is connected, as soon as a client can see it; the next round settles the set (a
        draining replica answers that one None)."""
        new = frozenset(replica_ids) - self.live
        if new:
            self.live |= new
            self._introduce_now.set()

    async def wait_for_replicas(self) -> None:
        """A first call through the handle waits until it knows the replica set."""
        try:
            await asyncio.wait_for(self.control.ping.remote(), timeout=5.0)
        except Exception as e:
            logger.warning("no replica answered: %r", e)

    def channel_stats(self) -> dict[str, Any] | None:
        """/stats' view of the stream channel: where replicas send tokens, how many streams it expects now (0 when
        idle), which replicas are live, connected and routable, how requests went."""
        inbox = self.inbox
        if inbox is None:
            return None
        return {"host": inbox.host, "port": inbox.port, "open_streams": inbox.num_open,
                "serve_replicas": sorted(self.live), "connected_replicas": sorted(inbox.links),
                "routable_replicas": sorted(link.replica_id for link in inbox.routable_links()),
                "requests_sent": dict(self.requests_sent)}
