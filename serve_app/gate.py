"""The router's gate: what every HTTP request passes before any route sees it (an ASGI middleware).

In this order, on the raw request, so no path spelling gets around it (``//v1/completions``,
``/v1/./completions``, ``/v1/%63ompletions``, a trailing slash, another method: everything but exactly
``GET <root>/health`` needs a key):

1. headers over ``MAX_HEADER_BYTES`` (names and values together): 431;
2. with API keys configured, ``Authorization: Bearer <key>``: the key's SHA-256 is compared with every
   configured key's (``hmac.compare_digest``, all of them, no early exit); no match: 401 ``invalid_api_key``.
   The key's tenant goes into the request's scope state (``tenant``). Without keys the server is open (it
   says so once at start);
3. a body over ``MAX_BODY_BYTES``: 413, from ``Content-Length`` before anything is read, or as soon as a
   chunked body passes the bound (the route never sees it);
4. a body not received whole within ``BODY_TIMEOUT_S`` (a client trickling it): 408 and the connection
   closed. The route reads the body before it asks for an admission slot, so a slow client never holds one.

API keys come from ``INFLIGHT_API_KEYS="tenant-a:key-a,tenant-b:key-b"`` or a file (``api_keys_file`` in the
app's arguments: one ``tenant key`` a line, ``#`` comments), never from the serve config itself; no key is
ever logged or quoted in an error.
"""

from __future__ import annotations

import hashlib
import asyncio
import hmac
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from inflight.serve_app.errors import (APIError, BodyTimeoutError, HeadersTooLargeError, RequestTooLargeError,
                              UnauthorizedError)

logger = logging.getLogger("ray.serve")

API_KEYS_ENV = "INFLIGHT_API_KEYS"
MAX_HEADER_BYTES = 32 * 1024
MAX_BODY_BYTES = 4 * 1024 * 1024
BODY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class APIKeys:
    """Tenants by the SHA-256 digest of their keys (the keys themselves are not kept)."""

    digests: tuple[tuple[bytes, str], ...] = ()

    @property
    def open(self) -> bool:
        return not self.digests

    def tenant_of(self, key: str) -> str | None:
        digest = hashlib.sha256(key.encode()).digest()
        found = None
        for known, tenant in self.digests:  # every key compared: the time does not say which one is close
            if hmac.compare_digest(digest, known):
                found = tenant
        return found


def load_api_keys(api_keys_file: str | None = None, environ: dict[str, str] | None = None) -> APIKeys:
    """The keys of ``INFLIGHT_API_KEYS`` and of ``api_keys_file``; a malformed entry is a ValueError that names
    its place, never its text."""
    environ = os.environ if environ is None else environ
    pairs: list[tuple[str, str]] = []
    for i, entry in enumerate(e for e in environ.get(API_KEYS_ENV, "").split(",") if e.strip()):
        tenant, sep, key = entry.strip().partition(":")
        if not sep or not tenant or not key:
            raise ValueError(f"{API_KEYS_ENV}: entry {i + 1} is not tenant:key")
        pairs.append((tenant, key))
    if api_keys_file:
        try:
            lines = open(api_keys_file, encoding="utf-8").read().splitlines()
        except OSError as e:
            raise ValueError(f"api_keys_file: cannot read {api_keys_file}: {e.strerror}") from None
        for number, line in enumerate(lines, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"api_keys_file: line {number} is not 'tenant key'")
            pairs.append((parts[0], parts[1]))
    if any(len(key) < 8 for _, key in pairs):
        raise ValueError("API keys must be at least 8 characters long")
    return APIKeys(tuple((hashlib.sha256(key.encode()).digest(), tenant) for tenant, key in pairs))


UNAUTHORIZED = UnauthorizedError("missing or invalid API key (send Authorization: Bearer <key>)",
                                 code="invalid_api_key")
HEADERS_TOO_LARGE = HeadersTooLargeError(f"request headers are larger than {MAX_HEADER_BYTES} bytes",
                                         code="request_header_fields_too_large")
BODY_TOO_LARGE = RequestTooLargeError(f"request body is larger than {MAX_BODY_BYTES} bytes", code="request_too_large")


class _BodyRefused(Exception):
    def __init__(self, error: APIError) -> None:
        self.error = error


class Gate:
    """ASGI middleware: ``api.add_middleware(Gate)``. The keys are the app's ``state.api_keys`` (the router sets
    them when it starts; none: open), the body's time limit its ``state.body_timeout_s`` (else ``BODY_TIMEOUT_S``)."""

    def __init__(self, app, max_header_bytes: int = MAX_HEADER_BYTES, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_header_bytes = max_header_bytes
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers") or []
        if sum(len(name) + len(value) for name, value in headers) > self.max_header_bytes:
            await _respond(send, HEADERS_TOO_LARGE)
            return
        keys: APIKeys = getattr(scope["app"].state, "api_keys", None) or APIKeys()
        if not keys.open and not _is_health(scope):
            tenant = keys.tenant_of(_bearer(headers))
            if tenant is None:
                await _respond(send, UNAUTHORIZED)
                return
            scope.setdefault("state", {})["tenant"] = tenant
        length = _content_length(headers)
        if length is not None and length > self.max_body_bytes:
            await _respond(send, BODY_TOO_LARGE)
            return
        state = scope["app"].state
        timeout_s = getattr(state, "body_timeout_s", None) or BODY_TIMEOUT_S
        body_deadline = asyncio.get_running_loop().time() + timeout_s
        received, body_done, started = 0, False, False

        async def bounded_receive():
            nonlocal received, body_done
            if body_done:  # after the body only a disconnect comes: no limit on waiting for it
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), body_deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                raise _BodyRefused(BodyTimeoutError(f"request body not received within {timeout_s:g} s",
                                                    code="request_timeout")) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise _BodyRefused(BODY_TOO_LARGE)
                body_done = not message.get("more_body", False)
            return message

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, bounded_receive, tracking_send)
        except _BodyRefused as refused:
            if not started:
                await _respond(send, refused.error)


def _is_health(scope: dict[str, Any]) -> bool:
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    return scope.get("method") == "GET" and path == "/health"


def _bearer(headers) -> str:
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


def _content_length(headers) -> int | None:
    for name, value in headers:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _respond(send, error: APIError) -> None:
    """``error`` as the router would answer it (serve_app.errors: status, OpenAI body, headers), sent from here."""
    body = json.dumps(error.body()).encode()
    headers = [(name.lower().encode(), value.encode()) for name, value in error.headers().items()]
    await send({"type": "http.response.start", "status": error.status_code,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})
