"""The gateway's errors, one tree (in the style of httpx's `_exceptions.py`):

    GatewayError
    ├── InvalidRequest        400  malformed JSON, missing or ill-typed fields, prompt too long,
    │                              a field kvgate does not forward, JSON nested too deep
    ├── RequestTimeout        408  the body did not arrive within `body_read_timeout_s`
    ├── PayloadTooLarge       413  the body is over `max_body_bytes` (refused while reading)
    ├── UnsupportedMediaType  415  a body declared as something other than JSON
    ├── NoSuchRoute           404/405  an unknown path, or a method the path does not take
    ├── ClientGone            499  the client left before the answer (counted, never sent)
    ├── InternalError         500  the last resort: an unexpected exception, logged with the
    │                              request id the client is given (never its text)
    ├── ModelNotFound         404  no replica serves the requested model
    ├── TenantError           401  missing, unknown or revoked API key
    │   └── Forbidden         403  a known key asking for what its tenant may not use
    ├── QuotaExceeded         429  over a rate limit (carries Retry-After)
    │   └── QueueFull         429  the scope's own backlog in the flow-control queue is full
    ├── NoReplica             503  no healthy replica for the model
    ├── Overloaded            503  the fleet has no room for anyone: the gateway's queue is full
    │                              or a request waited `flow_max_queue_s` (carries Retry-After)
    ├── UpstreamError         502  every attempt at an engine failed
    └── EngineRejected        4xx  an engine refused the request (its 4xx, for front ends that
                                   cannot relay the engine's body unchanged)

Errors are mapped to the wire in one place only, `gateway.api.errors`: to HTTP bodies in
OpenAI's shape and in Anthropic's, and to gRPC status codes, each by the error's HTTP status.
This module holds the tree alone (no framework), so any layer may raise them.
"""

from __future__ import annotations

import orjson


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


class RequestTimeout(GatewayError):
    status = 408
    type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="request_timeout")


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="body_too_large")


class UnsupportedMediaType(GatewayError):
    status = 415
    type = "invalid_request_error"

    def __init__(self, content_type: str) -> None:
        super().__init__(
            f"the request body is declared as '{content_type}'; send JSON with "
            "'Content-Type: application/json'",
            code="unsupported_media_type",
        )


class NoSuchRoute(GatewayError):
    """A path the API does not have (404), or a method it does not take there (405, with the
    methods it takes in `Allow`): in the API's own error shape, not the framework's."""

    type = "invalid_request_error"

    def __init__(self, status: int, method: str, path: str, allow: str | None = None) -> None:
        if status == 405:
            message = f"{method} is not allowed on {path}" + (f"; use {allow}" if allow else "")
        else:
            message = f"no such route: {method} {path}"
        super().__init__(message, code="unknown_route" if status == 404 else "method_not_allowed")
        self.status = status
        self.allow = allow

    def headers(self) -> dict[str, str]:
        return {"allow": self.allow} if self.allow else {}


class ClientGone(GatewayError):
    """The client disconnected before its request was read or answered: nothing reaches it;
    the request is counted under status 499 (nginx's "client closed request"), not as a 5xx."""

    status = 499
    type = "client_closed_request"


class InternalError(GatewayError):
    """What the client learns of an unexpected exception: that it happened, and the request id
    under which the gateway logged it."""

    def __init__(self, request_id: str) -> None:
        super().__init__(
            f"internal error; the gateway logged it (request id {request_id})",
            code="internal_error",
        )
        self.request_id = request_id

    def headers(self) -> dict[str, str]:
        return {"x-request-id": self.request_id}


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


class QueueFull(QuotaExceeded):
    """This scope's own requests fill its flow-control queue (gateway.pipeline.flow)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message, retry_after_s)
        self.code = "queue_full"


class TooManyInFlight(QuotaExceeded):
    """429: the tenant has as many requests in flight as it may (`tenant_max_inflight`)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retry_after_s=1.0)
        self.code = "too_many_requests_in_flight"


class NoReplica(GatewayError):
    status = 503
    type = "service_unavailable_error"


class Overloaded(GatewayError):
    """The fleet has no room for anyone (Anthropic: `overloaded_error`; gRPC: UNAVAILABLE)."""

    status = 503
    type = "service_unavailable_error"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message, code="overloaded")
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"retry-after": str(max(1, round(self.retry_after_s + 0.5)))}


class UpstreamError(GatewayError):
    status = 502
    type = "upstream_error"


TOO_LARGE = "upstream_too_large"


def too_large(limit: int) -> UpstreamError:
    """502: an engine's whole answer passed `upstream_max_body_bytes` (not retried: its size is
    the request's doing, and another replica would answer as much)."""
    return UpstreamError(
        f"the engine's answer is larger than the gateway accepts ({limit} bytes)", code=TOO_LARGE
    )


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
