"""``Router``: the ingress deployment. OpenAI HTTP API, admission control, deadlines, migration.

A request's path: parse and validate (400 with OpenAI's error body), check the model (404), take an
admission slot or answer 429 with Retry-After, then send it to a replica: down that replica's own
connection to this router when every replica Serve runs is connected (``serve_app.stream_channel``,
``_LinkStream``; picked by the routing policy over the replicas' reported load and this router's
requests on each), else through the Serve handle (``_ChannelStream``; Serve's request router picks, and
the replica then connects). The replica's first message says the request is queued (or why not); after
that the router relays chunks as SSE or gathers them into one JSON body. The chunks come up the
connection either way (or, with ``stream_channel: false``, as the Serve call's own items). A replica
that dies before it answered is retried elsewhere (``max_attempts``); one that dies (or is drained)
mid-generation costs the client nothing: the router keeps what it relayed of each choice (its token
ids and text) and continues the request on another replica from there (``max_migrations``), on the
same stream, exactly: greedy and seeded choices go on as they would have (the router seeds a sampled
request that brought no seed), text held back for stop strings is still held, nothing is sent twice.
The deadline (``timeout``, or the configured default) covers queueing, prefill and decode: the engine
ends the request when it passes, and the router cancels the replica call if even that does not come
back in time.
"""

# No `from __future__ import annotations`: FastAPI must see real types on the ingress methods.
import asyncio
import json
import logging
import secrets
import time
import uuid
import weakref
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
import ray
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from inflight.serve_app import responses as R
from inflight.serve_app.admission import AdmissionController, TenantLimiter
from inflight.serve_app.config import RouterConfig
from inflight.serve_app.errors import (ERROR_BODY_SCHEMA, ERROR_STATUSES, APIError, BadRequestError, EngineLost,
                              ModelNotFoundError, OverloadedError, RequestTimeoutError, ServerError,
                              ServiceUnavailableError)
from inflight.serve_app.metrics import RouterMetrics
from inflight.engine.models.source import read_model_source
from inflight.serve_app.gate import API_KEYS_ENV, Gate, load_api_keys
from inflight.serve_app.ports import reclaim_own_port_at_restart
from inflight.serve_app import request_router
from inflight.serve_app.routing import ReplicaLoad, RoutingPolicy, fresh_stats, request_block_hashes
from inflight.serve_app.stream_channel import End, ReplicaLink, StreamInbox, StreamLost
from inflight.serve_app.tools import template_tools
from inflight.serve_app.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                               TokenizeRequest)

logger = logging.getLogger("ray.serve")

DEADLINE_GRACE_S = 2.0  # the engine ends a late request itself; the router steps in only after this
CHANNEL_GRACE_S = 10.0  # a replica's call ended but its last chunks have not come this long after: lost
INTRODUCE_PERIOD_S = 1.0  # how often a router tells every replica where to connect (serve_app.stream_channel)
MIN_INTRODUCE_PERIOD_S = 0.2  # ... and at most this often, when a replica it should route to is not connected


class ReplicaDraining(ConnectionError):
    """A request sent on a replica's connection just as Serve began stopping that replica: it goes elsewhere."""


class ReplicaFailed(RuntimeError):
    """A replica's request failed with an error of the replica's own (a bug): a 500 for the client."""


REPLICA_GONE = (RayActorError, ActorDiedError, ActorUnavailableError, StreamLost, EngineLost, ReplicaDraining)

api = FastAPI(title="inflight", docs_url="/docs")
api.add_middleware(Gate)  # header and body bounds, API keys: before any route (serve_app/gate.py)


class _Slot:
    """A request's admission: the router's slot and, for a tenant, its share; released once, settling the
    tenant's token budget with the request's ``usage`` (``total_tokens``) when it is known."""

    def __init__(self, router: "Router", tenant: str | None, reserved: int) -> None:
        self.router, self.tenant, self.reserved = router, tenant, reserved
        self.usage: dict[str, int] = {}
        self._released = False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        router = self.router
        router.admission.release()
        if self.tenant is not None:
            used = self.usage.get("total_tokens")
            router.tenants.release(self.tenant, self.reserved, used)
            router.metrics.tenant_requests.inc(tags={"tenant": self.tenant})
            if used:
                router.metrics.tenant_tokens.inc(used, tags={"tenant": self.tenant})


def _reject_lone_surrogates(data: Any) -> None:
    """JSON's "\\ud800" escapes can make a str that is not Unicode text (a lone surrogate): no tokenizer takes
    it, so it is a 400 here, wherever it is in the body. Iterative: a body can nest deep."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise BadRequestError("request body holds a lone UTF-16 surrogate (U+D800-U+DFFF), which is not "
                                      "Unicode text") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _seeded(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with a seed of the router's when the client gave none: a sampled request can then be continued
    on another replica exactly (its draws are a function of the seed and the output position)."""
    return params if params.get("seed") is not None else {**params, "seed": secrets.randbits(63)}


def _tokens_to_reserve(body, kind: str) -> int:
    """A request's tokens before they are known: its prompts at ~4 characters a token (token ids as they are)
    and its output bound (``max_tokens``, else 256), for each of its ``n`` choices; an embedding's inputs alone."""
    if kind == "chat":
        prompts = ["".join(str(m.content or "") for m in body.messages)]
        max_tokens = body.max_new_tokens()
    elif kind == "embedding":
        prompts, max_tokens = body.inputs(), 0
    else:
        prompts = body.prompts()
        max_tokens = body.max_tokens
    prompt_tokens = sum(len(p) if isinstance(p, list) else len(p) // 4 + 1 for p in prompts)
    return prompt_tokens + len(prompts) * getattr(body, "n", 1) * (max_tokens if max_tokens is not None else 256)


class ReplicaLost(Exception):
    """The replicas serving a request went away more often than ``max_migrations``: it cannot be continued."""


class _Progress:
    """What the client has been sent of one prompt's choices (the replicas' chunks as relayed): per choice its
    token ids, the length of its text and whether it ended. Enough to continue the request on another replica
    exactly (``continued``): the engine counts those tokens as output, holds back what was held back, and a
    sampled choice draws what it would have drawn (its seed's draws depend on the output position only)."""

    def __init__(self, n: int) -> None:
        self.token_ids: list[list[int]] = [[] for _ in range(n)]
        self.text_len = [0] * n
        self.ended = [False] * n

    def add(self, chunk: dict[str, Any]) -> None:
        for choice in chunk["choices"]:
            i = choice["index"]
            self.token_ids[i].extend(choice["token_ids"])
            self.text_len[i] += len(choice["text"]) - choice.get("echoed", 0)  # the generated text's characters
            self.ended[i] = self.ended[i] or choice["finish_reason"] is not None

    @property
    def finished(self) -> bool:
        return all(self.ended)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    def continued(self, payload: dict[str, Any], migration: int) -> dict[str, Any]:
        """``payload`` continued from here: its unfinished choices, from what the client has; the prompt's
        echo and prompt logprobs were sent already."""
        params = {k: v for k, v in payload["params"].items() if k != "prompt_logprobs"}
        continue_from = [{"index": i, "token_ids": self.token_ids[i], "text_len": self.text_len[i]}
                         for i in range(len(self.ended)) if not self.ended[i]]
        # Not refused as unmeetable: it was admitted once; its deadline still ends it.
        return {**payload, "request_id": f"{payload['request_id']}-m{migration}", "params": params, "echo": False,
                "client_timeout": False, "continue_from": continue_from}


async def _end_of(response) -> dict[str, Any] | None:
    try:
        return await response.__anext__()
    except StopAsyncIteration:
        return None


class _InboxStream:
    """One attempt's messages as they arrive in the router's inbox (``serve_app.stream_channel``): the stream ends
    with the message that says the request finished or was refused, or with the error that ends ``_next``.
    ``cancel`` (each kind's own) stops the request where it runs."""

    inbox: StreamInbox
    route: dict[str, Any]
    finished: bool

    def __aiter__(self) -> "_InboxStream":
        return self

    async def __anext__(self) -> dict[str, Any]:
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
        if "error" in message or message["finished"]:
            self.finished = True
            self.inbox.close(self.route)
        return message

    async def _next(self) -> dict[str, Any]:
        raise NotImplementedError

    def cancel(self) -> None:
        raise NotImplementedError


class _ChannelStream(_InboxStream):
    """One attempt's messages when they come on the stream channel (``serve_app.stream_channel``).

    The Serve call is made as without the channel, with the route added; it yields nothing, and ends when
    the replica has sent the request's last message, or fails when the replica is lost: that end is queued
    behind the messages it followed. ``cancel`` cancels the call (which aborts the request in the engine),
    as for a plain call's generator."""

    def __init__(self, replicas: DeploymentHandle, inbox: StreamInbox, request: dict[str, Any]) -> None:
        self.inbox = inbox
        self.route, self.queue = inbox.open()
        self.response = replicas.generate.remote({**request, "route": self.route})
        self.end = asyncio.ensure_future(_end_of(self.response))
        self.end.add_done_callback(self._on_end)
        self.call_ended = False
        self.finished = False

    async def _next(self) -> dict[str, Any]:
        item = await (asyncio.wait_for(self.queue.get(), CHANNEL_GRACE_S) if self.call_ended else self.queue.get())
        if type(item) is not End:
            if "replica_id" in item:  # the first message: which replica Serve picked
                self.inbox.attach(self.route, item["replica_id"])
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


class _LinkStream(_InboxStream):
    """One attempt's messages when the request itself went down a replica's connection (``ReplicaLink``): no Serve
    call at all. The connection's loss (closed, or silent) ends it with ``StreamLost`` behind the messages that
    came; ``cancel`` sends an abort, which leaves the stream in the engine (freeing its KV blocks)."""

    def __init__(self, link: ReplicaLink, inbox: StreamInbox, request: dict[str, Any]) -> None:
        self.link, self.inbox = link, inbox
        self.route, self.queue = inbox.open(link)
        link.generate({**request, "route": {"key": self.route["key"]}})
        self.finished = False

    async def _next(self) -> dict[str, Any]:
        message = await self.queue.get()
        if type(message) is End:
            raise message.error
        if len(message) == 1:  # how the request ended on the replica, when that was not a last message
            if "lost" in message:
                raise EngineLost(message["lost"])
            if "draining" in message:
                raise ReplicaDraining("its replica is being stopped")
            if "failed" in message:
                raise ReplicaFailed(message["failed"])
        return message

    def cancel(self) -> None:
        if not self.finished and self.route["key"] in self.link.keys:  # still running there
            self.link.abort(self.route["key"])
        self.inbox.close(self.route)


def _lost_reason(error: BaseException) -> str:
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


class _ClosingStreamingResponse(StreamingResponse):
    """Closes its body when the response ends, however it ends. Starlette leaves a body that was cut off (a
    client gone while a chunk was being sent) suspended until it is garbage collected, and with it the replica
    call under it running: closing it cancels that call (which aborts the request in the engine) at once."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class _Prepended:
    """``first``, then ``rest``'s items. Closing it closes ``rest`` even before anything was taken (an async
    generator closed before it started runs no ``finally``, and ``rest``'s call would be left running)."""

    def __init__(self, first: dict[str, Any], rest: AsyncIterator[dict[str, Any]]) -> None:
        self.first: dict[str, Any] | None = first
        self.rest = rest

    def __aiter__(self) -> "_Prepended":
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self.first is not None:
            first, self.first = self.first, None
            return first
        return await self.rest.__anext__()

    async def aclose(self) -> None:
        await self.rest.aclose()


_BODY_SCHEMAS: dict[str, Any] = {}  # the request models' sub-schemas, for /openapi.json's components


def _body(model: type) -> dict[str, Any]:
    """A route's request body for /openapi.json: the routes read the raw body (so bad input is OpenAI's 400, not
    FastAPI's 422), so the schema their pydantic model checks is declared here instead."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    _BODY_SCHEMAS.update(schema.pop("$defs", {}))
    _BODY_SCHEMAS[model.__name__] = schema
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}},
            "responses": _ERROR_RESPONSES}


# Every error status a route (or the gate before it) may answer, each with OpenAI's error body.
_ERROR_RESPONSES = {str(status): {"description": name, "content": {"application/json": {
    "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}} for status, name in sorted(ERROR_STATUSES.items())}
_BODY_SCHEMAS["ErrorResponse"] = ERROR_BODY_SCHEMA


def _openapi() -> dict[str, Any]:
    if api.openapi_schema is None:
        schema = get_openapi(title=api.title, version=api.version, routes=api.routes)
        schema.setdefault("components", {}).setdefault("schemas", {}).update(_BODY_SCHEMAS)
        api.openapi_schema = schema
    return api.openapi_schema


api.openapi = _openapi


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers())


@api.exception_handler(StarletteHTTPException)
async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes and wrong methods get OpenAI's error body too, not FastAPI's ``{"detail": ...}``."""
    error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    body = {"error": {"message": str(exc.detail), "type": error_type, "param": None, "code": None}}
    return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return _error_response(BadRequestError(str(exc.errors()[:3])))


# Everything the class uses must be defined above it: serve.ingress captures the class when it is decorated.
@serve.ingress(api)
class Router:
    def __init__(self, replicas: DeploymentHandle, config: RouterConfig) -> None:
        reclaim_own_port_at_restart()  # make run's :8000 stays the router's across its restarts
        self.replicas = replicas.options(stream=True)
        self.control = replicas  # unary calls: stats, ping
        self.config = config
        self.model_name = config.served_model_name
        self.admission = AdmissionController(config.max_pending_requests)
        self.tenants = TenantLimiter(config.tenant_limits, config.default_tenant_limits)
        self.metrics = RouterMetrics()
        self.created = int(time.time())
        self.inbox = StreamInbox(ray.util.get_node_ip_address()) if config.stream_channel else None
        # Requests sent down replicas' connections are routed here, by the same policies as Serve's calls.
        self.link_policy = RoutingPolicy(config.routing_policy)
        self._replicas_key = (replicas.app_name, replicas.deployment_name)  # for request_router.live_replicas
        self._live_replicas = request_router.live_replicas  # the module travels by name, so this is the live one
        self._introduce_now = asyncio.Event()
        self.requests_sent = {"connection": 0, "serve_call": 0}  # how attempts went (/stats)
        self._introductions: asyncio.Task | None = None
        try:  # introduce this router to the replicas from the start, so that the first burst finds them connected
            asyncio.get_running_loop()
            self._start_introductions()
        except RuntimeError:  # no event loop here (Serve builds the class in one): from the first request on
            pass
        # Prefix affinity routes by the engine's own block hashes (engine.block_hash), so the router tokenizes:
        # the replica then takes the token ids as they are. The model's files must be readable here.
        self.tokenizer = (read_model_source(config.model).tokenizer if config.routing_policy == "prefix_affinity"
                          else None)
        api.state.api_keys = load_api_keys(config.api_keys_file)
        api.state.body_timeout_s = config.body_timeout_s
        if api.state.api_keys.open:
            logger.warning("no API keys configured (%s or api_keys_file): this server answers anyone who can "
                           "reach it", API_KEYS_ENV)
        else:
            logger.info("API keys required: %d configured", len(api.state.api_keys.digests))

    # -- routes ------------------------------------------------------------------------------------
    @api.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "inflight"}]}

    @api.get("/stats")
    async def stats(self) -> dict[str, Any]:
        """Every replica's engine state, asked of each replica now (``handle.broadcast``)."""
        results: list = []
        for attempt in range(2):
            try:
                results = await asyncio.wait_for(self.control.broadcast("stats").results_async(), timeout=5.0)
                break
            except Exception as e:  # the handle has not seen the replicas yet, or one is dying
                if attempt == 0:
                    await self._wait_for_replicas()
                else:
                    logger.warning("stats broadcast failed: %r", e)
        replicas = [r for r in results if isinstance(r, dict)]
        return {"replicas": sorted(replicas, key=lambda s: s["replica_id"]),
                "router": {"in_flight": self.admission.in_flight, "max_pending_requests": self.admission.max_in_flight,
                           "num_rejected": self.admission.num_rejected,
                           # where replicas send tokens, and how many streams it expects now (0 when idle)
                           "stream_channel": None if self.inbox is None else
                           {"host": self.inbox.host, "port": self.inbox.port, "open_streams": self.inbox.num_open,
                            "serve_replicas": sorted(self._live_replicas(*self._replicas_key) or ()),
                            "connected_replicas": sorted(self.inbox.links),
                            "routable_replicas": sorted(link.replica_id for link in self.inbox.routable_links()),
                            "requests_sent": dict(self.requests_sent)}}}

    @api.post("/v1/completions", openapi_extra=_body(CompletionRequest))
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest, "completion")

    @api.post("/v1/chat/completions", openapi_extra=_body(ChatCompletionRequest))
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, ChatCompletionRequest, "chat")

    @api.post("/v1/embeddings", openapi_extra=_body(EmbeddingRequest))
    async def embeddings(self, request: Request) -> Response:
        try:
            body, slot = await self._admit(request, EmbeddingRequest, "embedding")
        except APIError as e:
            return _error_response(e)
        try:
            deadline = time.monotonic() + (body.timeout or self.config.default_timeout_s)
            payload = {"request_id": "embd-" + uuid.uuid4().hex, "inputs": body.inputs(),
                       "client_timeout": body.timeout is not None}
            result = await self._embed(payload, deadline)
            slot.usage["total_tokens"] = result["prompt_tokens"]
            return JSONResponse(R.embedding_response(self.model_name, result["embeddings"], result["prompt_tokens"],
                                                     body.encoding_format))
        except APIError as e:
            return _error_response(e)
        finally:
            slot.release()

    @api.post("/tokenize", openapi_extra=_body(TokenizeRequest))
    async def tokenize(self, request: Request) -> Response:
        """vLLM's tokenizer endpoints (clients such as ``vllm bench serve`` align prompt lengths with them):
        a replica answers, since its tokenizer and chat template are the engine's."""
        return await self._ask_replica(request, TokenizeRequest, lambda body: self.control.tokenize.remote(body.payload()))

    @api.post("/detokenize", openapi_extra=_body(DetokenizeRequest))
    async def detokenize(self, request: Request) -> Response:
        return await self._ask_replica(request, DetokenizeRequest, lambda body: self.control.detokenize.remote(body.tokens))

    async def _ask_replica(self, http: Request, schema: type, call) -> Response:
        try:
            body = await self._parse(http, schema)
            if body.model is not None and body.model != self.model_name:
                raise ModelNotFoundError(f"model {body.model!r} does not exist; this server serves "
                                         f"{self.model_name!r}", param="model", code="model_not_found")
            try:
                answer = call(body)  # building the call reads the body (a message's parts): it may refuse it
            except ValueError as e:
                raise BadRequestError(str(e), param="messages") from None
            try:
                result = await asyncio.wait_for(answer, timeout=30.0)
            except Exception as e:
                raise ServiceUnavailableError(f"no replica could answer: {type(e).__name__}") from None
            if "error" in result:
                raise APIError.from_dict(result["error"])
            return JSONResponse(result)
        except APIError as e:
            return _error_response(e)

    # -- one request ---------------------------------------------------------------------------------
    async def _admit(self, http: Request, schema: type, kind: str) -> tuple[Any, "_Slot"]:
        """Parse and validate the body, check the model, take an admission slot and, for a key's tenant, its
        share (requests in flight, tokens per minute); raises ``APIError``. The caller releases the slot."""
        body = await self._parse(http, schema)
        if body.model != self.model_name:
            raise ModelNotFoundError(f"model {body.model!r} does not exist; this server serves "
                                     f"{self.model_name!r}", param="model", code="model_not_found")
        retry_after = self.admission.try_acquire()
        if retry_after is not None:
            self.metrics.rejections.inc()
            raise OverloadedError(f"server is at capacity ({self.admission.max_in_flight} requests in flight); "
                                  f"retry later", retry_after_s=retry_after)
        tenant = http.scope.get("state", {}).get("tenant")
        slot = _Slot(self, tenant, _tokens_to_reserve(body, kind))
        if tenant is not None:
            refusal = self.tenants.try_admit(tenant, slot.reserved)
            if refusal is not None:
                self.admission.release()
                self.metrics.tenant_rejections.inc(tags={"tenant": tenant})
                retry_after, why = refusal
                raise OverloadedError(f"rate limited: {why}; retry later", retry_after_s=retry_after)
        return body, slot

    async def _serve(self, http: Request, schema: type, kind: str) -> Response:
        try:
            body, slot = await self._admit(http, schema, kind)
        except APIError as e:
            return _error_response(e)
        tenant = slot.tenant
        try:
            payloads = self._payloads(body, kind, tenant)
            deadline = time.monotonic() + (body.timeout or self.config.default_timeout_s)
            if body.stream:
                stream = await self._stream_response(payloads, body, kind, deadline, slot.usage)
                body_iter = self._released(stream, slot)
                # If the client leaves before the body starts, the generator never runs its `finally`;
                # releasing when it is collected makes sure the admission slot still comes back.
                weakref.finalize(body_iter, slot.release)
                return _ClosingStreamingResponse(body_iter, media_type="text/event-stream")
            result = await self._full_response(payloads, body, kind, deadline)
            slot.usage.update(result["usage"])
            slot.release()
            return JSONResponse(result)
        except APIError as e:
            slot.release()
            return _error_response(e)
        except BaseException:
            slot.release()
            raise

    async def _wait_for_replicas(self) -> None:
        """A first call through the handle waits until it knows the replica set."""
        try:
            await asyncio.wait_for(self.control.ping.remote(), timeout=5.0)
        except Exception as e:
            logger.warning("no replica answered: %r", e)

    @staticmethod
    async def _released(stream: AsyncIterator[str], slot: "_Slot") -> AsyncIterator[str]:
        try:
            async for item in stream:
                yield item
        finally:
            try:
                await stream.aclose()  # left at a yield, it would not close the stream under it
            finally:
                slot.release()

    async def _parse(self, http: Request, schema: type):
        try:
            raw = await http.body()
        except ClientDisconnect:  # gone before its body arrived: nobody to answer, nothing to log as an error
            raise BadRequestError("the client disconnected before sending the whole request body") from None
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise BadRequestError(f"request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise BadRequestError("request body must be a JSON object")
        _reject_lone_surrogates(data)
        try:
            return schema.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            message = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()[:5])
            raise BadRequestError(message, param=param) from None

    def _payloads(self, body, kind: str, tenant: str | None = None) -> list[dict[str, Any]]:
        """One replica request per prompt (a completions call may carry several prompts). A request of a tenant
        (an API key's) says so: the engine salts its prefix cache by tenant (tenants never share cached blocks)
        and, under the fair policy, shares its queue between tenants."""
        salt = {"tenant": tenant} if tenant is not None else {}  # the engine salts the tenant's cache with it
        base_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        if kind == "chat":
            try:
                messages = body.plain_messages()
            except ValueError as e:
                raise BadRequestError(str(e), param="messages") from None
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            params = _seeded({**body.sampling_kwargs(body.max_new_tokens(), logprobs), **salt})
            tools = template_tools(body.tools)
            payload = {"kind": "chat", "request_id": base_id, "messages": messages, "params": params,
                       "priority": body.priority, "client_timeout": body.timeout is not None,
                       "add_generation_prompt": body.add_generation_prompt, "tools": tools}
            if self.tokenizer is not None:
                try:
                    prompt = self.tokenizer.chat_prompt(messages, body.add_generation_prompt, tools)
                except ValueError as e:
                    raise BadRequestError(str(e), param="messages") from None
                payload.update(prompt_text=prompt["prompt"], prompt_token_ids=prompt["prompt_token_ids"])
            return [payload]
        params = {**body.completion_sampling_kwargs(), **salt}
        payloads = [{"kind": "completion", "request_id": base_id if i == 0 else f"{base_id}-{i}", "prompt": prompt,
                     "params": _seeded(params), "priority": body.priority, "client_timeout": body.timeout is not None,
                     "echo": body.echo}
                    for i, prompt in enumerate(body.prompts())]
        if self.tokenizer is not None:
            for payload in payloads:
                prompt = payload["prompt"]
                text = prompt if isinstance(prompt, str) else None
                payload.update(prompt_text=text, prompt_token_ids=self.tokenizer.encode(prompt) if text is not None
                               else prompt)
        return payloads

    async def _open(self, payload: dict[str, Any], deadline: float):
        """Start the request on some replica; returns (its chunks, an async iterator with ``cancel``; the first)."""
        if self.inbox is not None:
            await self.inbox.start()
            self._start_introductions()

            def stream(request: dict[str, Any]):
                link = self._pick_link(request)
                self.requests_sent["serve_call" if link is None else "connection"] += 1
                chunks = (_LinkStream(link, self.inbox, request) if link is not None
                          else _ChannelStream(self.replicas, self.inbox, request))
                return chunks, chunks.__anext__()
        else:
            def stream(request: dict[str, Any]):
                gen = self.replicas.generate.remote(request)
                return gen, gen.__anext__()

        return await self._first_answer(payload, deadline, stream)

    def _pick_link(self, request: dict[str, Any]) -> ReplicaLink | None:
        """The connected replica to send ``request`` down, by the routing policy over each one's latest stats and
        this router's requests on it; None (a Serve call instead) when none is connected, or all are draining or
        at ``max_requests_per_replica``."""
        routable = self.inbox.routable_links()
        live = self._live_replicas(*self._replicas_key)
        if not live or not live <= {link.replica_id for link in routable}:
            # Serve's replica set not known here yet (the first call makes the request router that learns it), or a
            # replica in it not connected (new, reconnecting): Serve's call reaches every replica; and that replica
            # is introduced now rather than at the next round.
            self._introduce_now.set()
            return None
        cap = self.config.max_requests_per_replica
        # Only replicas Serve still routes to: one it has begun to stop is told to drain a moment later.
        links = [link for link in routable if link.replica_id in live and len(link.keys) < cap]
        if not links:
            return None
        if len(links) == 1 and self.link_policy.policy != "prefix_affinity":
            return links[0]
        now = time.time()
        loads = [ReplicaLoad(link.replica_id, len(link.keys), fresh_stats(link.stats, now)) for link in links]
        hashes = request_block_hashes(self.link_policy, request, [link.stats for link in links])
        return self.inbox.links[self.link_policy.rank(loads, hashes)[0].replica_id]

    def _start_introductions(self) -> None:
        if self.inbox is not None and self._introductions is None:
            self._introductions = asyncio.ensure_future(self._introduce())

    async def _introduce(self) -> None:
        """Every ``INTRODUCE_PERIOD_S``: tell each replica Serve knows where to connect (a new one, one that lost
        its connection), and drop connections that fell silent."""
        await self.inbox.start()
        while True:
            if self._live_replicas(*self._replicas_key) is None:
                # A call through the handle makes this process's request router for the replicas, which Serve then
                # keeps told of the replica set (request_router.live_replicas). (A broadcast alone does not.)
                try:
                    await asyncio.wait_for(self.control.ping.remote(), timeout=2.0)
                except Exception as e:  # replicas still starting: the next round asks again
                    logger.debug("no replica answered a ping: %r", e)
            try:
                await asyncio.wait_for(self.control.broadcast("connect", self.inbox.address)
                                       .results_async(return_exceptions=True), timeout=5.0)
            except Exception as e:  # no replica yet: the next round tries again
                logger.debug("introduction round failed: %r", e)
            self.inbox.check_silence()
            await asyncio.sleep(MIN_INTRODUCE_PERIOD_S)
            self._introduce_now.clear()
            try:
                await asyncio.wait_for(self._introduce_now.wait(), INTRODUCE_PERIOD_S - MIN_INTRODUCE_PERIOD_S)
            except asyncio.TimeoutError:
                pass

    async def _first_answer(self, payload: dict[str, Any], deadline: float, call):
        """Send ``payload`` to a replica and await its first answer; returns (the call's response, that answer).

        ``call(request)`` makes the handle call and returns (response, awaitable of its first answer): a
        stream's first message, or a unary call's result. A replica lost before it answered is replaced by
        another (bounded by ``max_attempts``): nothing has reached the client yet. Every other failure
        cancels the call, which aborts the request in the engine."""
        last_error: BaseException | None = None
        for attempt in range(self.config.max_attempts):
            request = {**payload, "timeout_s": max(0.001, deadline - time.monotonic()),
                       # only a client's own timeout may be refused as unmeetable; the server default is a net
                       "strict_deadline": payload.get("client_timeout", False)}
            if attempt:
                request["request_id"] = f"{payload['request_id']}-retry{attempt}"
            response, first_answer = call(request)
            try:
                first = await asyncio.wait_for(first_answer, timeout=max(0.001, deadline + DEADLINE_GRACE_S
                                                                         - time.monotonic()))
            except REPLICA_GONE as e:
                last_error = e
                logger.warning("replica lost before request %s was answered (attempt %d): %r", payload["request_id"],
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
                logger.exception("replica failed request %s", payload["request_id"])
                raise ServerError(f"replica failed: {type(e).__name__}") from None
            if "error" in first:
                raise APIError.from_dict(first["error"])
            return response, first
        reason = _lost_reason(last_error) if last_error is not None else "no replica answered"
        raise ServiceUnavailableError(f"no replica could take the request in {self.config.max_attempts} attempts; "
                                      f"the last one failed because {reason}", code="replica_lost")

    async def _chunks(self, payload: dict[str, Any], deadline: float) -> AsyncIterator[dict[str, Any]]:
        """The replica's messages for one prompt. A replica lost mid-request is not the client's problem: the
        request continues on another replica from the tokens relayed so far (``_Progress``: exactly, nothing
        repeated or missing), at most ``max_migrations`` times; a replica lost before it answered is retried."""
        gen, first = await self._open(payload, deadline)
        progress = _Progress(payload["params"].get("n", 1))
        progress.add(first)
        migrations = 0
        try:
            # Inside the try: a consumer that leaves after the first message (a client gone before the body
            # started) must still cancel the call, when it closes this generator or drops it.
            yield first
            while True:
                try:
                    # (asyncio.timeout, not wait_for: on 3.11 wait_for wraps every message's wait in a task of its own)
                    async with asyncio.timeout(max(0.001, deadline + DEADLINE_GRACE_S - time.monotonic())):
                        chunk = await gen.__anext__()
                except StopAsyncIteration:
                    return
                except REPLICA_GONE as e:
                    if progress.finished:  # lost after its last tokens were relayed: nothing is missing
                        return
                    if migrations >= self.config.max_migrations:
                        raise ReplicaLost(f"the response was cut off after {progress.num_tokens} tokens because "
                                          f"{_lost_reason(e)}, {migrations} times; send the request again") from None
                    migrations += 1
                    self.metrics.migrations.inc(tags={"reason": "replica_lost"})
                    logger.warning("request %s: replica lost after %d tokens (%r); continuing it on another replica "
                                   "(migration %d)", payload["request_id"], progress.num_tokens, e, migrations)
                    gen, chunk = await self._open(progress.continued(payload, migrations), deadline)
                except asyncio.TimeoutError:
                    self.metrics.timeouts.inc()  # the router's own deadline guard fired, not the engine's
                    raise RequestTimeoutError("request timed out", code="timeout") from None
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    logger.exception("replica failed during request %s", payload["request_id"])
                    raise ServerError(f"replica failed: {type(e).__name__}") from None
                progress.add(chunk)
                yield chunk
        finally:
            gen.cancel()  # a no-op when finished; aborts the engine request when we leave early

    async def _embed(self, payload: dict[str, Any], deadline: float) -> dict[str, Any]:
        """One ``LLMReplica.embed`` call for all of a request's inputs (retried like a stream's start)."""
        def unary(request: dict[str, Any]):
            response = self.control.embed.remote(request)
            return response, response

        _, result = await self._first_answer(payload, deadline, unary)
        return result

    async def _full_response(self, payloads: list[dict[str, Any]], body, kind: str, deadline: float) -> dict:
        n = body.n
        tasks = [asyncio.ensure_future(self._collect(p, n, deadline)) for p in payloads]
        try:
            done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:  # one prompt failed (or we were cancelled): stop the others, which aborts them in the engine
            for task in tasks:
                task.cancel()
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()
        results = [task.result() for task in tasks]
        choices: list[R.ChoiceState] = []
        prompt_tokens = 0
        for i, (states, tokens) in enumerate(results):
            prompt_tokens += tokens
            for state in states:
                state.index = i * n + state.index
                choices.append(state)
        request_id = payloads[0]["request_id"]
        if kind == "chat":
            return R.chat_response(request_id, self.model_name, choices, prompt_tokens, body.logprobs,
                                   body.tool_reader())
        return R.completion_response(request_id, self.model_name, choices, prompt_tokens, body.logprobs is not None)

    async def _collect(self, payload: dict[str, Any], n: int, deadline: float) -> tuple[list[R.ChoiceState], int]:
        """One prompt's whole response (a replica lost on the way is replaced as for a stream: ``_chunks``)."""
        states = [R.ChoiceState(i) for i in range(n)]
        prompt_tokens = 0
        try:
            async for chunk in self._chunks(payload, deadline):
                if chunk.get("started"):
                    prompt_tokens = chunk["prompt_tokens"]
                for choice in chunk["choices"]:
                    states[choice["index"]].add(choice)
        except ReplicaLost as e:
            raise ServiceUnavailableError(str(e), code="replica_lost") from None
        if any(s.finish_reason == "timeout" for s in states):
            raise RequestTimeoutError("request timed out (queueing, prefill and decode)", code="timeout")
        if any(s.finish_reason == "abort" for s in states):
            raise ServiceUnavailableError("request was aborted by the engine")
        return states, prompt_tokens

    async def _stream_response(self, payloads: list[dict[str, Any]], body, kind: str,
                               deadline: float, usage: dict[str, int]) -> AsyncIterator[str]:
        if len(payloads) > 1:
            raise BadRequestError("streaming takes one prompt per request", param="prompt")
        chunks = self._chunks(payloads[0], deadline)
        first = await chunks.__anext__()  # errors before any byte is sent become HTTP statuses
        return self._sse(_Prepended(first, chunks), first["prompt_tokens"], payloads[0]["request_id"], body, kind,
                         usage)

    async def _sse(self, chunks: AsyncIterator[dict[str, Any]], prompt_tokens: int, request_id: str, body,
                   kind: str, usage: dict[str, int]) -> AsyncIterator[str]:
        """The SSE events of one streamed request; ``usage`` gets its token counts as they come (the tenant's
        budget is settled from them when the stream ends). One write per replica message: its events are joined,
        and the last message's go out with the usage and ``[DONE]``, so a request costs the HTTP stack (uvicorn,
        Serve's ingress, Starlette) a send per message rather than per event: about 3 sends a request instead of 6."""
        created = int(time.time())
        model = self.model_name
        completion_tokens = 0
        text_offsets = [0] * body.n
        # Declared tools: the text is read for calls once a choice ends, so it is held back until then.
        tool_reader = body.tool_reader() if kind == "chat" else None
        held_text = [""] * body.n
        events: list[str] = []
        add = events.append
        try:
            if kind == "chat":  # they go with the first message, which is here already (``_stream_response``)
                for i in range(body.n):
                    add(R.sse(R.chat_chunk(request_id, model, created, i, {"role": "assistant", "content": ""},
                                           None, None)))
            async for chunk in chunks:
                for choice in chunk["choices"]:
                    completion_tokens += len(choice["token_ids"])
                    usage["total_tokens"] = prompt_tokens + completion_tokens
                    reason = choice["finish_reason"]
                    if reason == "timeout":  # the engine ended it (and counted it)
                        raise RequestTimeoutError("request timed out (queueing, prefill and decode)", code="timeout")
                    if reason == "abort":
                        raise ServiceUnavailableError("request was aborted by the engine")
                    if not choice["text"] and not reason and not choice.get("logprobs"):
                        continue
                    if kind == "chat" and tool_reader is not None:
                        held_text[choice["index"]] += choice["text"]
                        if reason:
                            content, calls = tool_reader(held_text[choice["index"]])
                            delta = ({"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]} if calls
                                     else {"content": content or ""})
                            add(R.sse(R.chat_chunk(request_id, model, created, choice["index"], delta, None, None)))
                            add(R.sse(R.chat_chunk(request_id, model, created, choice["index"], {},
                                                   R.finish_reason(reason, calls), None)))
                    elif kind == "chat":
                        delta = {"content": choice["text"]} if choice["text"] or not reason else {}
                        logprobs = choice.get("logprobs") if body.logprobs else None
                        add(R.sse(R.chat_chunk(request_id, model, created, choice["index"], delta, reason, logprobs)))
                    else:
                        add(R.sse(R.completion_chunk(request_id, model, created, choice, text_offsets[choice["index"]],
                                                     body.logprobs is not None)))
                        text_offsets[choice["index"]] += len(choice["text"])
                # The last message (its stream ends right after it) waits for nothing: it goes out below.
                if events and not chunk.get("finished"):
                    yield "".join(events)
                    events.clear()
            if body.include_usage():
                obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
                add(R.sse(R.usage_chunk(request_id, model, created, obj, prompt_tokens, completion_tokens)))
        except (APIError, ReplicaLost) as e:
            error = e if isinstance(e, APIError) else ServiceUnavailableError(str(e), code="replica_lost")
            add(R.sse(error.body()))
        finally:
            await chunks.aclose()
        add(R.sse("[DONE]"))
        yield "".join(events)
