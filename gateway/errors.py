"""The gateway's errors, one tree (in the style of httpx's `_exceptions.py`):

    GatewayError
    ├── InvalidRequest        400  malformed JSON, missing or ill-typed fields, prompt too long
    ├── ModelNotFound         404  no replica serves the requested model
    ├── TenantError           401  missing, unknown or revoked API key
    │   └── Forbidden         403  a known key asking for what its tenant may not use
    ├── QuotaExceeded         429  over a rate limit (carries Retry-After)
    ├── NoReplica             503  no healthy replica for the model
    ├── UpstreamError         502  every attempt at an engine failed
    └── EngineRejected        4xx  an engine refused the request (its 4xx, for front ends that
                                   cannot relay the engine's body unchanged)

Errors are mapped here and nowhere else: to HTTP bodies in OpenAI's shape (`to_http`) and in
Anthropic's (`to_anthropic_http`), and to gRPC status codes (`to_grpc`), each by HTTP status.
"""

from __future__ import annotations

from typing import Any

import grpc
import orjson
from starlette.responses import Response


class GatewayError(Exception):
    status = 500
    type = "api_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def headers(self) -> dict[str, str]:
        return {}


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class ModelNotFound(GatewayError):
    status = 404
    type = "invalid_request_error"

    def __init__(self, model: str, available: list[str]) -> None:
        names = ", ".join(available) or "none"
        super().__init__(
            f"The model '{model}' does not exist; available models: {names}",
            param="model",
            code="model_not_found",
        )


class TenantError(GatewayError):
    status = 401
    type = "authentication_error"


class Forbidden(TenantError):
    status = 403
    type = "permission_error"


class QuotaExceeded(GatewayError):
    status = 429
    type = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message, code="rate_limit_exceeded")
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"retry-after": str(max(1, round(self.retry_after_s + 0.5)))}


class NoReplica(GatewayError):
    status = 503
    type = "service_unavailable_error"


class UpstreamError(GatewayError):
    status = 502
    type = "upstream_error"


class EngineRejected(GatewayError):
    """An engine's 4xx, carried as an error by the front ends that translate bodies."""

    type = "invalid_request_error"

    def __init__(self, status: int, body: bytes) -> None:
        message = body[:500].decode(errors="replace")
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            error = parsed.get("error")
            detail = error.get("message") if isinstance(error, dict) else parsed.get("message")
            if isinstance(detail, str):
                message = detail
        super().__init__(f"the engine refused the request: {message}", code="engine_rejected")
        self.status = status if 400 <= status < 500 else 400


def openai_error_body(err: GatewayError) -> dict[str, Any]:
    return {
        "error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}
    }


def to_http(err: GatewayError) -> Response:
    return Response(
        orjson.dumps(openai_error_body(err)),
        status_code=err.status,
        media_type="application/json",
        headers=err.headers(),
    )


# -- Anthropic's error shape --------------------------------------------------------------------
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
"""Anthropic's error types by HTTP status; other 4xx are `invalid_request_error`, anything else
an `api_error`."""


def anthropic_error_body(err: GatewayError) -> dict[str, Any]:
    fallback = "invalid_request_error" if 400 <= err.status < 500 else "api_error"
    kind = _ANTHROPIC_TYPES.get(err.status, fallback)
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def to_anthropic_http(err: GatewayError) -> Response:
    return Response(
        orjson.dumps(anthropic_error_body(err)),
        status_code=err.status,
        media_type="application/json",
        headers=err.headers(),
    )


# -- gRPC status codes --------------------------------------------------------------------------
_GRPC_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
"""gRPC's equivalents of the HTTP statuses (as grpc-gateway maps them); other 4xx are
INVALID_ARGUMENT, anything else INTERNAL."""


def to_grpc(err: GatewayError) -> tuple[Any, str, tuple[tuple[str, str], ...]]:
    """(status code, details, trailing metadata) for `ServicerContext.abort`."""
    code = _GRPC_CODES.get(err.status)
    if code is None:
        code = (
            grpc.StatusCode.INVALID_ARGUMENT
            if 400 <= err.status < 500
            else grpc.StatusCode.INTERNAL
        )
    return code, err.message, tuple(err.headers().items())
