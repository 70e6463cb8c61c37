"""Errors the HTTP API returns, and the one place that maps them to status codes and OpenAI error bodies."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error with an HTTP status and an OpenAI error body ``{"error": {"message", "type", "param", "code"}}``."""

    status_code = 500
    error_type = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, round(self.retry_after_s)))}

    def to_dict(self) -> dict[str, Any]:
        """Plain form, to cross from a replica to the router."""
        return {"kind": type(self).__name__, "message": self.message, "param": self.param, "code": self.code,
                "retry_after_s": self.retry_after_s}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "APIError":
        cls = _KINDS.get(data.get("kind"), APIError)
        return cls(data["message"], param=data.get("param"), code=data.get("code"),
                   retry_after_s=data.get("retry_after_s"))


class BadRequestError(APIError):
    status_code = 400
    error_type = "invalid_request_error"


class UnauthorizedError(APIError):
    """No valid API key (serve_app.gate)."""

    status_code = 401
    error_type = "invalid_request_error"

    def headers(self) -> dict[str, str]:
        return {**super().headers(), "WWW-Authenticate": "Bearer"}


class RequestTooLargeError(APIError):
    status_code = 413
    error_type = "invalid_request_error"


class HeadersTooLargeError(APIError):
    status_code = 431
    error_type = "invalid_request_error"


class BodyTimeoutError(APIError):
    """The client did not send its whole body in time (a trickled body): 408, the connection is closed."""

    status_code = 408
    error_type = "invalid_request_error"

    def headers(self) -> dict[str, str]:
        return {**super().headers(), "Connection": "close"}


class ModelNotFoundError(APIError):
    status_code = 404
    error_type = "invalid_request_error"


class OverloadedError(APIError):
    """The request cannot be taken now (queue full, or its deadline cannot be met): 429 + Retry-After."""

    status_code = 429
    error_type = "rate_limit_exceeded"


class RequestTimeoutError(APIError):
    status_code = 504
    error_type = "timeout"


class ServerError(APIError):
    """Something failed on our side; the body says what, without a traceback."""

    status_code = 500
    error_type = "server_error"


class ServiceUnavailableError(APIError):
    status_code = 503
    error_type = "service_unavailable"


# Every kind by name, for from_dict: derived, so a new error class cannot be left out.
_KINDS = {cls.__name__: cls for cls in (APIError, *APIError.__subclasses__())}


def param_of_value_error(message: str) -> str | None:
    """Engine ValueErrors start with the argument they are about ("max_tokens: ...", "top_p must ...")."""
    head = message.split(" ", 1)[0].rstrip(":,")
    return head if head.isidentifier() else None


# OpenAI's ErrorResponse, for /openapi.json: every error status a route may answer, with this body.
ERROR_BODY_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
ERROR_STATUSES = {cls.status_code: cls.__name__ for cls in _KINDS.values() if cls is not APIError}


class EngineLost(RuntimeError):
    """A replica's engine died under a request (its process killed or crashed): between the replica and the
    router, never an HTTP answer. The router treats the replica as lost: the request is retried, or its stream
    continued, on another replica. (The replica exits right after: ``replica._exit_without_an_engine``.)"""
