"""The HTTP front end: OpenAI-compatible routes. Handlers stay thin: authenticate, parse,
hand to the director, map errors in one place (`gateway.errors.to_http`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from gateway.api.anthropic import routes as anthropic_api
from gateway.api.asgi import Handler
from gateway.api.body import ClientWatch, client_left
from gateway.api.context import FrontEnd
from gateway.api.errors import to_http
from gateway.api.openai.parse import parse_chat, parse_completion
from gateway.api.openapi import REF as _REF
from gateway.api.responses import JSONBytes, OpenAISSE, debug_headers
from gateway.errors import GatewayError
from gateway.pipeline.forwarder import Passthrough
from gateway.request.parsed import ParsedRequest
from gateway.request.tenant import Tenant
from gateway.request.trace import trace_context
from gateway.tenancy.registry import bearer_key

_ERRORS = {
    str(status): {
        "description": why,
        "content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}},
    }
    for status, why in (
        (400, "Malformed JSON, a missing or ill-typed field, or a prompt over the maximum"),
        (401, "A missing, unknown or revoked API key"),
        (403, "The tenant may not use the model"),
        (404, "No replica serves the model"),
        (429, "The tenant is over its rate limit (see Retry-After)"),
        (502, "Every attempt at an engine failed"),
        (503, "No healthy replica"),
    )
}


def _body(model: str) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": _REF.format(model=model)}}},
        },
        "responses": {
            "200": {
                "description": "The completion (JSON), or an SSE stream when stream is true",
                "content": {
                    "application/json": {
                        "schema": {"$ref": _REF.format(model="CompletionResponse")}
                    },
                    "text/event-stream": {"schema": {"type": "string"}},
                },
            },
            **_ERRORS,
        },
    }


async def handle(
    front: FrontEnd,
    parsed: ParsedRequest,
    tenant: Tenant,
    trace_headers: dict[str, str] | None = None,
    client_left: Callable[[], Awaitable[object]] | None = None,
) -> Response:
    """Serve one OpenAI-shaped completion: the pipeline opens the exchange (admit, route,
    forward); its answer goes back as JSON, as the engine's SSE stream, or as the engine's 4xx.
    `client_left()`: returns when the client disconnects (watched while the request waits)."""
    with ClientWatch(client_left):
        opened = await front.pipeline.open(parsed, tenant, trace_headers, client_left)
        if isinstance(opened, Passthrough):
            return JSONBytes(opened.body, status_code=opened.status)
        if opened.parsed.stream:
            return OpenAISSE(opened, debug_headers(opened, front.debug_headers))
        body = await opened.complete()
    headers = debug_headers(opened, front.debug_headers)  # the replica that answered
    return JSONBytes(orjson.dumps(body), headers)


def build_router(front: FrontEnd) -> tuple[APIRouter, dict[str, Handler]]:
    """The routes, and the completion handlers by path for the hot-path dispatcher."""
    router = APIRouter()
    tenants, replicas = front.tenants, front.replicas
    max_prompt_bytes = front.max_prompt_bytes

    @router.post(
        "/v1/chat/completions",
        openapi_extra=_body("ChatCompletionRequest"),
        summary="Create a chat completion",
    )
    async def chat_completions(request: Request) -> Response:
        try:
            tenant = tenants.authenticate(bearer_key(request.headers.get("authorization")))
            parsed = parse_chat(await front.read(request), max_prompt_bytes)
            return await handle(
                front, parsed, tenant, trace_context(request.headers), client_left(request)
            )
        except GatewayError as err:
            return to_http(err)

    @router.post(
        "/v1/completions",
        openapi_extra=_body("CompletionRequest"),
        summary="Create a completion",
    )
    async def completions(request: Request) -> Response:
        try:
            tenant = tenants.authenticate(bearer_key(request.headers.get("authorization")))
            parsed = parse_completion(await front.read(request), max_prompt_bytes)
            return await handle(
                front, parsed, tenant, trace_context(request.headers), client_left(request)
            )
        except GatewayError as err:
            return to_http(err)

    @router.get("/v1/models", summary="List the models the healthy replicas serve")
    async def models(request: Request) -> Response:
        try:
            tenant = tenants.authenticate(bearer_key(request.headers.get("authorization")))
        except GatewayError as err:
            return to_http(err)
        allowed = tenant.policy.models
        served = sorted(
            {
                m
                for s in replicas.states.values()
                if s.healthy
                for m in s.models
                if not allowed or m in allowed
            }
        )
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "kvgate"} for m in served]
        return JSONResponse({"object": "list", "data": data})

    @router.get("/healthz", summary="Liveness: the process serves HTTP")
    async def healthz() -> Response:
        return JSONResponse({"status": "ok"})

    @router.get("/readyz", summary="Readiness: at least one replica is healthy")
    async def readyz() -> Response:
        healthy = sum(1 for s in replicas.states.values() if s.healthy)
        status = 200 if healthy else 503
        return JSONResponse({"healthy_replicas": healthy}, status_code=status)

    hot: dict[str, Handler] = {
        "/v1/chat/completions": chat_completions,
        "/v1/completions": completions,
        anthropic_api.PATH: anthropic_api.register(router, front),
    }
    return router, hot
