"""The one place errors meet the wire: `gateway.errors`' tree mapped to HTTP bodies in OpenAI's
shape (`to_http`) and in Anthropic's (`to_anthropic_http`), and to gRPC status codes
(`to_grpc`), each by the error's HTTP status; and the last resort (`report_internal`), which
turns an unexpected exception into a logged `InternalError` with a request id."""

from __future__ import annotations

import contextlib
import logging
import secrets
from typing import Any

import grpc
import orjson
from starlette.responses import Response

from gateway.errors import GatewayError, InternalError, Overloaded

log = logging.getLogger(__name__)

_REPORTED = "_kvgate_request_id"
"""The attribute a reported exception carries (so a re-raised one is not logged twice)."""


def report_internal(exc: BaseException, where: str) -> InternalError:
    """Log an unexpected exception with its traceback under a new request id; the client gets
    the id only (never the exception's text, which may hold internals)."""
    request_id = getattr(exc, _REPORTED, None)
    if request_id is None:
        request_id = "req_" + secrets.token_hex(12)
        log.error("unexpected error serving %s (request id %s)", where, request_id, exc_info=exc)
        with contextlib.suppress(AttributeError):  # a type with __slots__: logged, that is all
            setattr(exc, _REPORTED, request_id)
    return InternalError(request_id)


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
ANTHROPIC_OVERLOADED = 529
"""Anthropic's status for `overloaded_error`: flow control's "the fleet has no room for anyone"
(`Overloaded`) is answered with it, as Anthropic's API does (its SDK raises `OverloadedError`
and retries it); other 503s (no healthy replica) keep 503."""


def anthropic_status(err: GatewayError) -> int:
    return ANTHROPIC_OVERLOADED if isinstance(err, Overloaded) else err.status


def anthropic_error_body(err: GatewayError) -> dict[str, Any]:
    fallback = "invalid_request_error" if 400 <= err.status < 500 else "api_error"
    kind = _ANTHROPIC_TYPES.get(err.status, fallback)
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def to_anthropic_http(err: GatewayError) -> Response:
    return Response(
        orjson.dumps(anthropic_error_body(err)),
        status_code=anthropic_status(err),
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
    499: grpc.StatusCode.CANCELLED,
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
