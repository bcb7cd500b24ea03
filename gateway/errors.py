"""The gateway's errors, one tree (in the style of httpx's `_exceptions.py`):

    GatewayError
    ├── InvalidRequest        400  malformed JSON, missing or ill-typed fields, prompt too long
    ├── ModelNotFound         404  no replica serves the requested model
    ├── TenantError           401  missing, unknown or revoked API key
    │   └── Forbidden         403  a known key asking for what its tenant may not use
    ├── QuotaExceeded         429  over a rate limit (carries Retry-After)
    ├── NoReplica             503  no healthy replica for the model
    └── UpstreamError         502  every attempt at an engine failed

Errors are mapped to HTTP bodies here and nowhere else (OpenAI's error shape).
"""

from __future__ import annotations

from typing import Any

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
