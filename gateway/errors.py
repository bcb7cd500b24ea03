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
