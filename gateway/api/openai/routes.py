"""The HTTP front end: OpenAI-compatible routes. Handlers stay thin: authenticate, parse,
hand to the director, map errors in one place (`gateway.errors.to_http`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from gateway.api.anthropic import routes as anthropic_api
from gateway.api.anthropic.schemas import ANTHROPIC_SCHEMAS, SECURITY_SCHEMES
from gateway.api.openai.parse import parse_chat, parse_completion
from gateway.api.openai.schemas import SCHEMAS
from gateway.errors import GatewayError, to_http
from gateway.observability import tracing
from gateway.pipeline.director import Director
from gateway.tenancy.registry import TenantRegistry, bearer_key

_REF = "#/components/schemas/{model}"
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


Handler = Callable[[Request], Awaitable[Response]]


def build_router(
    director: Director, tenants: TenantRegistry
) -> tuple[APIRouter, dict[str, Handler]]:
    """The routes, and the completion handlers by path for the hot-path dispatcher."""
    router = APIRouter()
    max_prompt_bytes = director.settings.max_prompt_bytes

    @router.post(
        "/v1/chat/completions",
        openapi_extra=_body("ChatCompletionRequest"),
        summary="Create a chat completion",
    )
    async def chat_completions(request: Request) -> Response:
        try:
            tenant = tenants.authenticate(bearer_key(request.headers.get("authorization")))
            parsed = parse_chat(await request.body(), max_prompt_bytes)
            return await director.handle(parsed, tenant, tracing.incoming(request.headers))
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
            parsed = parse_completion(await request.body(), max_prompt_bytes)
            return await director.handle(parsed, tenant, tracing.incoming(request.headers))
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
                for s in director.replicas.states.values()
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
        healthy = sum(1 for s in director.replicas.states.values() if s.healthy)
        status = 200 if healthy else 503
        return JSONResponse({"healthy_replicas": healthy}, status_code=status)

    hot: dict[str, Handler] = {
        "/v1/chat/completions": chat_completions,
        "/v1/completions": completions,
        anthropic_api.PATH: anthropic_api.register(router, director, tenants),
    }
    return router, hot


class GatewayASGI:
    """The ASGI app uvicorn serves: the completion routes (OpenAI's two and Anthropic's
    /v1/messages) go straight to their handlers
    (the same functions FastAPI routes to), everything else through FastAPI.

    FastAPI's middleware stack cost ~0.15 ms of CPU per proxied request here, about a fifth of
    the gateway's whole budget, and the completion handlers parse their bodies themselves
    anyway. The routes stay declared in FastAPI, so the OpenAPI document describes them.
    """

    def __init__(self, api: FastAPI, hot: dict[str, Handler]) -> None:
        self.api = api
        self.state = api.state
        self._hot = hot

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self._hot.get(scope["path"])
            if handler is not None:
                response = await handler(Request(scope, receive))
                await response(scope, receive, send)
                return
        await self.api(scope, receive, send)


def install_openapi(app: FastAPI) -> None:
    """Put the hand-parsed request bodies' schemas into the OpenAPI components."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (*SCHEMAS, *ANTHROPIC_SCHEMAS):
                definition = model.model_json_schema(ref_template=_REF)
                components.update(definition.pop("$defs", {}))
                components[model.__name__] = definition
            schema["components"]["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer"},
                **SECURITY_SCHEMES,
            }
            schema["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
