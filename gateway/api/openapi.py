"""The OpenAPI document: FastAPI's, with the hand-parsed request bodies' schemas in its
components (the hot path never runs pydantic; these only document it)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from gateway.api.anthropic.schemas import ANTHROPIC_SCHEMAS, SECURITY_SCHEMES
from gateway.api.openai.schemas import SCHEMAS

REF = "#/components/schemas/{model}"


def install_openapi(app: FastAPI) -> None:
    """Put the hand-parsed request bodies' schemas into the OpenAPI components."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (*SCHEMAS, *ANTHROPIC_SCHEMAS):
                definition = model.model_json_schema(ref_template=REF)
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
