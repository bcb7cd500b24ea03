"""The one error mapping: each error of the tree to its HTTP status, its OpenAI and Anthropic
bodies, and its gRPC status code."""

from __future__ import annotations

import grpc
import orjson
import pytest

from gateway.api.errors import anthropic_error_body, to_anthropic_http, to_grpc, to_http
from gateway.errors import (
    EngineRejected,
    Forbidden,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    NoReplica,
    QuotaExceeded,
    TenantError,
    UpstreamError,
)


@pytest.mark.parametrize(
    ("error", "status", "anthropic_type", "code"),
    [
        (InvalidRequest("bad"), 400, "invalid_request_error", grpc.StatusCode.INVALID_ARGUMENT),
        (ModelNotFound("m", ["a"]), 404, "not_found_error", grpc.StatusCode.NOT_FOUND),
        (TenantError("who"), 401, "authentication_error", grpc.StatusCode.UNAUTHENTICATED),
        (Forbidden("no"), 403, "permission_error", grpc.StatusCode.PERMISSION_DENIED),
        (QuotaExceeded("slow", 2.2), 429, "rate_limit_error", grpc.StatusCode.RESOURCE_EXHAUSTED),
        (NoReplica("none"), 503, "overloaded_error", grpc.StatusCode.UNAVAILABLE),
        (UpstreamError("down"), 502, "api_error", grpc.StatusCode.UNAVAILABLE),
        (
            EngineRejected(422, b"{}"),
            422,
            "invalid_request_error",
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (EngineRejected(404, b"{}"), 404, "not_found_error", grpc.StatusCode.NOT_FOUND),
        (GatewayError("bug"), 500, "api_error", grpc.StatusCode.INTERNAL),
    ],
)
def test_each_error_maps_to_one_status_everywhere(
    error: GatewayError, status: int, anthropic_type: str, code: grpc.StatusCode
) -> None:
    assert to_http(error).status_code == status
    response = to_anthropic_http(error)
    assert response.status_code == status
    assert orjson.loads(response.body) == anthropic_error_body(error)
    assert anthropic_error_body(error) == {
        "type": "error",
        "error": {"type": anthropic_type, "message": error.message},
    }
    got, details, _ = to_grpc(error)
    assert (got, details) == (code, error.message)


def test_a_quota_error_carries_retry_after_everywhere() -> None:
    error = QuotaExceeded("over the limit", 2.2)
    assert to_http(error).headers["retry-after"] == "3"
    assert to_anthropic_http(error).headers["retry-after"] == "3"
    assert to_grpc(error)[2] == (("retry-after", "3"),)


def test_an_engines_refusal_keeps_the_engines_message() -> None:
    body = orjson.dumps({"error": {"message": "context too long", "type": "BadRequestError"}})
    assert EngineRejected(400, body).message == "the engine refused the request: context too long"
    assert "not json" in EngineRejected(400, b"not json").message
