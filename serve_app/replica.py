"""``LLMReplica``: one engine per replica, streaming typed messages (``serve_app.messages``) to the router.

The engine class is injected (``engine_cls``) so tests and other engines can stand in. Messages are
plain data, never tensors: ``Started`` with the prompt's length and the first tokens, ``Chunk``s of new tokens,
``Finished``; or a single ``Refused`` when the request is refused. (The first tokens and
the acknowledgement travel in one message: one round trip less before the first token.) Requests come
two ways: down a router's connection (``serve_app.stream_channel``; each router introduces itself with
``connect``), their messages going back up it; or as Serve calls, whose messages go up the router's
connection too when the request brings a ``route`` (the call then yields nothing: it ends when they have
all been sent, or fails when the replica is lost), else as the call's own items.

Messages cost CPU that the engine shares (through Ray Serve a few thousand per second is all two
cores give; on the channel each chunk still becomes an SSE event that the router relays), so they are paced: the
engine hands a stream an output (its first tokens at once: time to first token is untouched) at most every
``streams producing / max_messages_per_s`` seconds (``AsyncLLMEngine``'s ``max_outputs_per_s``; a stream waiting
for a batch slot takes no share), the tokens between gathering into the next, and each output is a message. So the replica as a whole sends about
``max_messages_per_s`` messages whatever the load: at the default 200 a single stream gets a message every 5 ms (a
token each while a step takes longer), many streams several tokens a message; and its event loop handles an output
per message, not one per step and stream. Leaving the stream early aborts the request in the engine, which frees
its KV blocks in the next step.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, AsyncIterator

import ray
from ray import serve

from inflight.engine import (AsyncLLMEngine, Continuation, DeadlineUnmeetableError, EngineDeadError, PoolingParams,
                    SamplingParams)
from inflight.engine.outputs import RequestOutput
from inflight.engine.models.packaged import DEFAULT_MODEL
from inflight.serve_app.admission import DrainRate
from inflight.serve_app.autoscaling import autoscaling_metrics
from inflight.serve_app.errors import (APIError, BadRequestError, EngineLost, OverloadedError, RequestTimeoutError,
                              ServiceUnavailableError, param_of_value_error)
from inflight.serve_app.messages import (Continued, Draining, EmbedRequest, Embeddings, Failed, GenerateRequest, Lost,
                                         Refused, ReplicaStats, Route, Started, StreamEvent)
from inflight.serve_app.metrics import ReplicaMetrics
from inflight.serve_app.rank_actors import RankActors
from inflight.serve_app.replica_output import Echo, replica_stats, stream_message
from inflight.serve_app.responses import pack_embedding
from inflight.serve_app.stream_channel import GENERATE, HEARTBEAT_S, ReplicaConnection, StreamOutbox

logger = logging.getLogger("ray.serve")

STRUCTURED_COMPILE_TIMEOUT_S = 10.0  # a constraint that takes longer to compile is a 400


class LLMReplica:
    def __init__(self, model: str = DEFAULT_MODEL, engine_args: dict[str, Any] | None = None,
                 served_model_name: str | None = None, max_queued_requests: int = 256,
                 max_messages_per_s: float = 200.0, engine_cls: type = AsyncLLMEngine,
                 engine_process: bool = False, engine_cpus: str | None = None,
                 stats_period_s: float = HEARTBEAT_S, rank_bundle: dict[str, float] | None = None) -> None:
        self.model_name = served_model_name or model
        engine_args = dict(engine_args or {})
        if engine_process and engine_cls is AsyncLLMEngine:  # a stand-in engine runs where it is
            engine_args.update(engine_process=True, engine_cpus=engine_cpus)
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside Serve (unit use): no replica context
            self.replica_id = "local"
        self.ranks: RankActors | None = None  # the engine's tensor-parallel ranks but rank 0, as actors
        size = engine_args.get("tensor_parallel_size", 1)
        if isinstance(size, int) and size > 1 and engine_cls is AsyncLLMEngine and ray.is_initialized():
            self.ranks = RankActors(size, rank_bundle or {}, f"inflight-{self.replica_id}")
            engine_args.update(self.ranks.engine_args())
        # Every output of a stream is a message: the engine paces them to the budget.
        try:
            self.engine = engine_cls(model, max_outputs_per_s=max_messages_per_s, **engine_args)
        except BaseException:
            if self.ranks is not None:
                self.ranks.stop()
            raise
        self.max_queued_requests = max_queued_requests
        # The engine's gauges, and the stats each router gets on its connection: as often as the deployment's
        # routing stats (routing_stats_period_s, what Serve's request router sees), and at least every
        # HEARTBEAT_S, since they are also the connection's heartbeat.
        self.stats_period_s = min(stats_period_s, HEARTBEAT_S)
        self.metrics = ReplicaMetrics()
        self.engine.step_observer = self.metrics.observe_step
        self.drain = DrainRate()
        self.node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"
        self._stats_task: asyncio.Task | None = None
        self.outbox = StreamOutbox(self.replica_id, on_frame=self._on_channel_frame, on_close=_abort_its_requests,
                                   greeting=self.stats)
        self.draining = False
        self.engine.death_observer = _exit_without_an_engine

    # -- requests -----------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[StreamEvent]:
        """The request's messages: as this call's items, or, when it brings a ``route``, on the router's stream
        channel, the call then yielding nothing and ending when the last of them is on its way."""
        messages = self._messages(request)
        route = request.route
        try:
            if route is None:
                async for message in messages:
                    yield message
                return
            channel, key = self._connection(route), route.key
            try:
                async for message in messages:
                    channel.send(key, message)
                await channel.drain()
            finally:
                await messages.aclose()
        except EngineDeadError as e:
            # Not this request's fault, nor the client's: the router continues it elsewhere. (When the replica's
            # actor is killed, its engine's process can die a moment before it, and this is what the call sees.)
            raise EngineLost(str(e)) from None

    # -- requests on the stream channel ----------------------------------------------------------------
    async def connect(self, address: Route) -> str | None:
        """A router introduces itself (``handle.broadcast``, every second): connect to it if not connected, so that
        it can send requests down the connection instead of through Serve. Returns this replica's id (None once
        it is draining: it takes nothing new)."""
        if self.draining:
            return None
        self._connection(address)
        return self.replica_id

    def _connection(self, route: Route) -> ReplicaConnection:
        """The connection to a router, opened if need be (its first news is this replica's stats, and the
        heartbeat that follows them starts)."""
        self._ensure_stats_task()
        return self.outbox.connection(route)

    def _on_channel_frame(self, connection: ReplicaConnection, op: str, payload: GenerateRequest | int) -> None:
        if op == GENERATE:
            key = payload.route.key
            task = asyncio.get_running_loop().create_task(self._generate_on(connection, key, payload))
            connection.tasks[key] = task
            task.add_done_callback(lambda _, key=key: connection.tasks.pop(key, None))
        else:  # an abort, by key
            task = connection.tasks.get(payload)
            if task is not None:
                task.cancel()  # leaving the stream aborts the request in the engine

    async def _generate_on(self, connection: ReplicaConnection, key: int, request: GenerateRequest) -> None:
        """A request that came on a router's connection: its messages go back up it, and so does how it ended
        when that is not a last message (``lost``: the engine died; ``failed``: a bug here)."""
        if self.draining:  # sent before the router heard that this replica is draining: it goes elsewhere
            connection.send(key, Draining())
            return
        messages = self._messages(request)
        try:
            async for message in messages:
                connection.send(key, message)
        except EngineDeadError as e:
            _send_if_open(connection, key, Lost(str(e)))
        except ConnectionError:
            pass  # the router is gone; its connection's close aborts the rest
        except Exception as e:
            logger.exception("request %s failed", request.request_id)
            _send_if_open(connection, key, Failed(type(e).__name__))
        finally:
            await messages.aclose()

    def __del__(self):
        """Serve stops this replica (scale-down, redeploy): it takes no new request, and the requests it runs get
        until Serve's graceful timeout (``drain_timeout_s``) to finish; whatever is left then continues on another
        replica (the router's migration). Serve waits for its own calls before this; the channel's are waited for
        here: Serve awaits the coroutine returned. (Not an ``async def``: collected outside Serve, with no router
        connected, there is nothing to wait for, and no coroutine is left un-awaited.)"""
        if getattr(self, "draining", True) or all(c.broken for c in self.outbox.connections()):
            return None
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # the garbage collector's call, outside any event loop
            return None
        self.draining = True
        self.outbox.tell_all(Draining())
        return self._wait_for_channel_requests()

    async def _wait_for_channel_requests(self) -> None:
        while any(c.tasks for c in self.outbox.connections()):
            await asyncio.sleep(0.1)

    async def _messages(self, request: GenerateRequest) -> AsyncIterator[StreamEvent]:
        self._ensure_stats_task()
        # A request continued from a lost replica was admitted once: it is not refused for a full queue here.
        refusal = (None if request.continue_from is not None
                   else self._refuse_if_full(self.engine.stats()["num_waiting"]))
        if refusal is not None:
            yield refusal
            return
        try:
            prompt = self._prompt(request)
            # Delta outputs: each carries only the new tokens, so no step copies a request's whole output.
            params = SamplingParams(**request.params, timeout_s=request.timeout_s,
                                    reject_unmeetable_deadline=request.strict_deadline,
                                    output_kind="delta")
            await self.engine.check_structured_output(params, STRUCTURED_COMPILE_TIMEOUT_S)  # off the event loop
            stream = self.engine.submit(prompt, params, request_id=request.request_id, priority=request.priority,
                                        continuations=_continuations(request.continue_from))
        except ValueError as e:
            yield Refused(BadRequestError(str(e), param=param_of_value_error(str(e))).to_dict())
            return
        num_prompt_tokens = len(stream.prompt_token_ids)
        self.metrics.prompt_tokens.inc(max(1, num_prompt_tokens * params.n))
        started: Started | None = Started(self.replica_id, num_prompt_tokens, ())
        num_generated = 0
        echo = self._echo(request, stream.prompt_token_ids, params) if request.echo else None
        try:
            async for output in stream:  # paced by the engine (max_outputs_per_s): each one is a message
                num_generated += sum(len(c.token_ids) for c in output.outputs)
                yield stream_message(output, params.logprobs or 0, echo, started)
                started = None
                if output.finished:
                    self._on_finished(output, num_generated)
        except DeadlineUnmeetableError as e:  # refused at admission (before any output): a late first token predicted
            yield self._refuse_unmeetable(e)
        finally:
            # counted once per request: a metric update per message costs more than it (Ray refuses inc(0):
            # a prefill-only request, or one that ended before its first token, generated nothing)
            if num_generated:
                self.metrics.generation_tokens.inc(num_generated)

    async def embed(self, request: EmbedRequest) -> Embeddings | Refused:
        """``/v1/embeddings``: every input is an engine request (the prefill lane batches them together). If the
        call is cancelled (the client left, the router's deadline passed), every input is aborted."""
        self._ensure_stats_task()
        stats = self.engine.stats()
        refusal = self._refuse_if_full(stats["num_waiting"] + stats.get("num_prefill_lane_waiting", 0))
        if refusal is not None:
            return refusal
        params = PoolingParams(timeout_s=request.timeout_s, reject_unmeetable_deadline=request.strict_deadline)
        inputs = request.inputs
        streams = []
        for i, prompt in enumerate(inputs):
            try:
                streams.append(self.engine.submit(prompt, params, request_id=f"{request.request_id}-{i}"))
            except ValueError as e:
                await _abort_all(self.engine, streams)
                where = f"input[{i}]: " if len(inputs) > 1 else ""
                return Refused(BadRequestError(f"{where}{e}", param="input").to_dict())
        tasks = [asyncio.ensure_future(_final_output(stream)) for stream in streams]
        try:
            outputs = await asyncio.gather(*tasks)
        except DeadlineUnmeetableError as e:  # refused at admission (mixed mode): a late result predicted
            return self._refuse_unmeetable(e)
        finally:
            for task in tasks:  # a request whose stream is left unfinished is aborted (the stream's own finally)
                task.cancel()
        num_prompt_tokens = sum(len(s.prompt_token_ids) for s in streams)
        self.metrics.prompt_tokens.inc(num_prompt_tokens)
        self.drain.record(len(outputs))
        reasons = {o.outputs[0].finish_reason for o in outputs}
        if "timeout" in reasons:
            error: APIError = RequestTimeoutError("request timed out (queueing and the forward)", code="timeout")
            return Refused(error.to_dict())
        if "abort" in reasons:
            return Refused(ServiceUnavailableError("request was aborted by the engine").to_dict())
        return Embeddings([pack_embedding(o.embedding) for o in outputs], num_prompt_tokens)

    def _refuse_if_full(self, queued: int) -> Refused | None:
        """The 429 message when ``queued`` requests already wait here (Retry-After from the drain rate), else None."""
        if queued < self.max_queued_requests:
            return None
        self.metrics.rejections.inc()
        retry = self.drain.seconds_to_drain(queued - self.max_queued_requests + 1)
        return Refused(OverloadedError(f"replica queue is full ({queued} waiting)", retry_after_s=retry).to_dict())

    def _refuse_unmeetable(self, error: DeadlineUnmeetableError) -> Refused:
        """The 429 message for a request the engine refused at admission: its deadline cannot be met."""
        self.metrics.rejections.inc()
        return Refused(OverloadedError(str(error), retry_after_s=error.retry_after_s).to_dict())

    def _prompt(self, request: GenerateRequest):
        if request.prompt_token_ids is not None:  # the router tokenized it (prefix affinity hashes the ids)
            return {"prompt": request.prompt_text, "prompt_token_ids": request.prompt_token_ids}
        if request.kind == "chat":
            return self.engine.tokenizer.chat_prompt(request.messages, request.add_generation_prompt, request.tools)
        return request.prompt

    def _echo(self, request: GenerateRequest, prompt_token_ids: list[int], params: SamplingParams) -> Echo:
        tokenizer = self.engine.tokenizer
        prompt = request.prompt
        text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt_token_ids)
        return Echo(text, params.prompt_logprobs, tokenizer.decode(prompt_token_ids[:1], skip_special_tokens=False))

    def _on_finished(self, output: RequestOutput, num_tokens: int) -> None:
        self.drain.record()
        timed_out = any(c.finish_reason == "timeout" for c in output.outputs)
        self.metrics.observe_finished(output.metrics, num_tokens // max(1, len(output.outputs)), timed_out)

    # -- state ---------------------------------------------------------------------------------------
    def stats(self) -> ReplicaStats:
        return replica_stats(self.engine.stats(), self.replica_id, self.node_id, self.model_name,
                             router_connections=sum(not c.broken for c in self.outbox.connections()))

    async def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Serve for the request router: exact engine state, time-stamped (a dict, as Serve's API has
        it; ``LLMRequestRouter`` reads it back as ``ReplicaStats``)."""
        self._ensure_stats_task()
        return self.stats().to_dict()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Polled by Serve's autoscaler when the deployment autoscales: this replica's engine load."""
        return autoscaling_metrics(self.engine.stats())

    async def check_health(self) -> None:
        self.engine.check_health()  # raises EngineDeadError if the step loop died
        if self.ranks is not None:
            self.ranks.check()  # a tensor-parallel rank's actor has ended

    async def tokenize(self, request: dict[str, Any]) -> dict[str, Any]:
        """``/tokenize`` (a payload of ``protocol.TokenizeRequest``): the ids the engine would see, as vLLM's
        server answers (``count``, ``max_model_len``, ``tokens``, ``token_strs``); ``{"error": ...}`` if refused."""
        tokenizer = self.engine.tokenizer
        try:
            if "messages" in request:
                ids = tokenizer.chat_prompt(request["messages"], request["add_generation_prompt"])["prompt_token_ids"]
            else:
                ids = tokenizer.encode(request["prompt"], add_special_tokens=request["add_special_tokens"])
        except ValueError as e:
            return Refused(BadRequestError(str(e), param="messages").to_dict())
        strs = [tokenizer.id_to_token(i) for i in ids] if request.get("return_token_strs") else None
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, token_ids: list[int]) -> dict[str, Any]:
        """``/detokenize``: the text of ``token_ids``; ``{"error": ...}`` for ids outside the vocabulary."""
        tokenizer = self.engine.tokenizer
        if token_ids and (min(token_ids) < 0 or max(token_ids) >= tokenizer.vocab_size):
            return Refused(BadRequestError(f"token ids must be in [0, {tokenizer.vocab_size})",
                                           param="tokens").to_dict())
        return {"prompt": tokenizer.decode(token_ids)}

    async def ping(self) -> str:
        return self.replica_id

    def _ensure_stats_task(self) -> None:
        if self._stats_task is None:
            self._stats_task = asyncio.get_running_loop().create_task(self._publish_stats())

    async def _publish_stats(self) -> None:
        while True:
            try:
                self.metrics.observe_stats(self.engine.stats())
                if len(self.outbox):  # each router's view of this replica's load, and a heartbeat
                    self.outbox.tell_all(self.stats())
            except Exception:  # metrics must never take the replica down
                logger.exception("failed to publish engine metrics")
            await asyncio.sleep(self.stats_period_s)


def _exit_without_an_engine(error: BaseException) -> None:
    """A replica whose engine died can serve nothing: it exits now, as if its process had been killed. Its routers
    see it gone at once (their streams on it continue on other replicas, requests that had not started are retried
    there), and Serve replaces it. Alive, it would look idle to least-loaded routing and draw every retry until a
    health check failed (seen: a request retried three times onto it, then answered 503)."""
    logger.error("the engine died (%r): this replica exits so that Serve replaces it", error)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(1)


def _abort_its_requests(connection: ReplicaConnection) -> None:
    """A router's connection closed: nobody is left to read its requests' tokens, so they are aborted (their
    router, if it lives, continues them elsewhere)."""
    for task in list(connection.tasks.values()):
        task.cancel()


def _send_if_open(connection: ReplicaConnection, key: int, message: StreamEvent) -> None:
    try:
        connection.send(key, message)
    except ConnectionError:
        pass


def _continuations(continue_from: tuple[Continued, ...] | None) -> dict[int, Continuation] | None:
    """The router's ``continue_from`` (a request that ran on a replica since lost or drained): per unfinished
    choice its index, the token ids the client got and the characters of text it was sent."""
    if continue_from is None:
        return None
    return {c.index: Continuation(tuple(c.token_ids), c.text_len) for c in continue_from}


async def _final_output(stream) -> RequestOutput:
    output = None
    async for output in stream:
        pass
    return output


async def _abort_all(engine, streams: list) -> None:
    """Abort submitted requests whose streams were never iterated (such a stream has not started, so leaving
    it would not abort anything): abort by id, then read each stream to its (aborted) end."""
    for stream in streams:
        await engine.abort(stream.request_id)
    for stream in streams:
        try:
            await asyncio.wait_for(_final_output(stream), timeout=5.0)
        except Exception:  # the engine is dead or slow; the request ends with it
            logger.warning("could not drain aborted embedding request %s", stream.request_id)
