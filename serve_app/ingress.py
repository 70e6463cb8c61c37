"""``Router``: the ingress deployment. The OpenAI HTTP API: routes, their handlers, /openapi.json, error bodies.

A request's path: parse and validate (400 with OpenAI's error body; ``request_builder``), check the model (404),
take an admission slot or answer 429 with Retry-After (``admission``), then send it to a replica
(``replica_client``: down that replica's own connection to this router when every replica Serve runs is
connected, else through the Serve handle). The replica's first message says the request is queued (or why not);
after that the router relays messages as SSE or gathers them into one JSON body (``answers``). A replica that dies
before it answered is retried elsewhere (``max_attempts``); one that dies (or is drained) mid-generation costs the
client nothing: the request continues on another replica from what was relayed (``migration``). The deadline
(``timeout``, or the configured default) covers queueing, prefill and decode: the engine ends the request when it
passes, and the router cancels the replica call if even that does not come back in time.
"""

# No `from __future__ import annotations`: FastAPI must see real types on the ingress methods.
import asyncio
import functools
import logging
import time
import uuid
import weakref
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
import ray
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from inflight.engine.models.source import read_model_source
from inflight.serve_app import answers, migration
from inflight.serve_app import responses as R
from inflight.serve_app.admission import RouterAdmission, Slot
from inflight.serve_app.config import RouterConfig
from inflight.serve_app.errors import (ERROR_BODY_SCHEMA, ERROR_STATUSES, APIError, BadRequestError,
                                       ServiceUnavailableError)
from inflight.serve_app.gate import API_KEYS_ENV, Gate, load_api_keys
from inflight.serve_app.messages import EmbedRequest, GenerateRequest, Refused
from inflight.serve_app.metrics import RouterMetrics
from inflight.serve_app.ports import reclaim_own_port_at_restart
from inflight.serve_app.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                                         TokenizeRequest)
from inflight.serve_app.replica_client import ReplicaClient
from inflight.serve_app.request_builder import check_model, generate_requests, parse_body, tokens_to_reserve

logger = logging.getLogger("ray.serve")

api = FastAPI(title="inflight", docs_url="/docs")
api.add_middleware(Gate)  # header and body bounds, API keys: before any route (serve_app/gate.py)


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
        self.config = config
        self.model_name = config.served_model_name
        self.metrics = RouterMetrics()
        self.admission = RouterAdmission(config.max_pending_requests, config.tenant_limits,
                                         config.default_tenant_limits, self.metrics)
        self.created = int(time.time())
        self.client = ReplicaClient(replicas, config, self.metrics, ray.util.get_node_ip_address())
        try:  # introduce this router to the replicas from the start, so that the first burst finds them connected
            asyncio.get_running_loop()
            self.client.start_introductions()
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
                results = await asyncio.wait_for(self.client.control.broadcast("stats").results_async(), timeout=5.0)
                break
            except Exception as e:  # the handle has not seen the replicas yet, or one is dying
                if attempt == 0:
                    await self.client.wait_for_replicas()
                else:
                    logger.warning("stats broadcast failed: %r", e)
        replicas = [r.to_dict() for r in results if hasattr(r, "to_dict")]
        self.client.heard_from(r["replica_id"] for r in replicas)
        requests = self.admission.requests
        return {"replicas": sorted(replicas, key=lambda s: s["replica_id"]),
                "router": {"in_flight": requests.in_flight, "max_pending_requests": requests.max_in_flight,
                           "num_rejected": requests.num_rejected, "stream_channel": self.client.channel_stats()}}

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
            embed = EmbedRequest("embd-" + uuid.uuid4().hex, body.inputs(), client_timeout=body.timeout is not None)
            result = await self.client.embed(embed, deadline)
            slot.usage["total_tokens"] = result.num_prompt_tokens
            return JSONResponse(R.embedding_response(self.model_name, result.embeddings, result.num_prompt_tokens,
                                                     body.encoding_format))
        except APIError as e:
            return _error_response(e)
        finally:
            slot.release()

    @api.post("/tokenize", openapi_extra=_body(TokenizeRequest))
    async def tokenize(self, request: Request) -> Response:
        """vLLM's tokenizer endpoints (clients such as ``vllm bench serve`` align prompt lengths with them):
        a replica answers, since its tokenizer and chat template are the engine's."""
        return await self._ask_replica(request, TokenizeRequest,
                                       lambda body: self.client.control.tokenize.remote(body.payload()))

    @api.post("/detokenize", openapi_extra=_body(DetokenizeRequest))
    async def detokenize(self, request: Request) -> Response:
        return await self._ask_replica(request, DetokenizeRequest,
                                       lambda body: self.client.control.detokenize.remote(body.tokens))

    async def _ask_replica(self, http: Request, schema: type, call) -> Response:
        try:
            body = await parse_body(http, schema)
            if body.model is not None:
                check_model(body.model, self.model_name)
            try:
                answer = call(body)  # building the call reads the body (a message's parts): it may refuse it
            except ValueError as e:
                raise BadRequestError(str(e), param="messages") from None
            try:
                result = await asyncio.wait_for(answer, timeout=30.0)
            except Exception as e:
                raise ServiceUnavailableError(f"no replica could answer: {type(e).__name__}") from None
            if type(result) is Refused:
                raise APIError.from_dict(result.error)
            return JSONResponse(result)
        except APIError as e:
            return _error_response(e)

    # -- one request ---------------------------------------------------------------------------------
    async def _admit(self, http: Request, schema: type, kind: str) -> tuple[Any, Slot]:
        """Parse and validate the body, check the model, take an admission slot and, for a key's tenant, its
        share (requests in flight, tokens per minute); raises ``APIError``. The caller releases the slot."""
        body = await parse_body(http, schema)
        check_model(body.model, self.model_name)
        tenant = http.scope.get("state", {}).get("tenant")
        return body, self.admission.admit(tenant, tokens_to_reserve(body, kind))

    async def _serve(self, http: Request, schema: type, kind: str) -> Response:
        try:
            body, slot = await self._admit(http, schema, kind)
        except APIError as e:
            return _error_response(e)
        try:
            requests = generate_requests(body, kind, slot.tenant, self.tokenizer)
            deadline = time.monotonic() + (body.timeout or self.config.default_timeout_s)
            messages = functools.partial(self._messages, deadline=deadline)
            if body.stream:
                if len(requests) > 1:
                    raise BadRequestError("streaming takes one prompt per request", param="prompt")
                stream = messages(requests[0])
                first = await stream.__anext__()  # errors before any byte is sent become HTTP statuses
                events = answers.sse(stream, first, requests[0].request_id, body, kind, self.model_name, slot.usage)
                body_iter = self._released(events, slot)
                # If the client leaves before the body starts, the generator never runs its `finally`;
                # releasing when it is collected makes sure the admission slot still comes back.
                weakref.finalize(body_iter, slot.release)
                return answers.ClosingStreamingResponse(body_iter, media_type="text/event-stream")
            result = await answers.full_response(messages, requests, body, kind, self.model_name)
            slot.usage.update(result["usage"])
            slot.release()
            return JSONResponse(result)
        except APIError as e:
            slot.release()
            return _error_response(e)
        except BaseException:
            slot.release()
            raise

    def _messages(self, request: GenerateRequest, deadline: float):
        return migration.messages(self.client, request, deadline, self.config.max_migrations, self.metrics)

    @staticmethod
    async def _released(stream: AsyncIterator[str], slot: Slot) -> AsyncIterator[str]:
        try:
            async for item in stream:
                yield item
        finally:
            try:
                await stream.aclose()  # left at a yield, it would not close the stream under it
            finally:
                slot.release()
