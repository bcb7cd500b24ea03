"""HTTP routes of billing: the admin ledger endpoints and a tenant's explicit cached contents.

Admin (an `admin_keys` key; a tenant's key gets 403):
    GET /admin/billing/export?tenant=T&from=ISO&to=ISO&format=csv|jsonl|parquet
    GET /admin/billing/summary[?from=ISO][&to=ISO][&tenant=T]

Explicit cached contents (the tenant's own key; profile google_explicit):
    POST   /v1/cached_contents        {model, messages, tools?, ttl_s? | expire_time?}
    GET    /v1/cached_contents/{id}
    PATCH  /v1/cached_contents/{id}   {ttl_s | expire_time}      moves the expiry (rent follows)
    DELETE /v1/cached_contents/{id}                              ends it now (rent refunded)
A chat request names one with `"cached_content": id`: its messages (and tools) lead the prompt.
Creating one runs its prefill on a replica (max_tokens 1) through the pipeline, so the KV exists
and the engine counts its tokens exactly. The rules live in `gateway.billing.explicit`; the
routes authenticate, parse and answer.
"""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Query, Request
from starlette.responses import JSONResponse, Response

from gateway.api.body import load_json_object
from gateway.api.context import FrontEnd
from gateway.api.errors import to_http
from gateway.api.openai.parse import parse_chat
from gateway.billing.explicit import CREATE_FIELDS, ExplicitContents, instant, object_json
from gateway.billing.export import FORMATS, MEDIA_TYPES, FormatUnavailable, encode, summarize
from gateway.billing.pricing.model import BillingError
from gateway.billing.pricing.money import plain
from gateway.billing.service import Billing
from gateway.errors import Forbidden, GatewayError, InvalidRequest, TenantError, UpstreamError
from gateway.pipeline.forwarder import Passthrough
from gateway.request.tenant import Tenant, hash_key
from gateway.tenancy.registry import TenantRegistry, bearer_key


def check_admin(billing: Billing, tenants: TenantRegistry, request: Request) -> None:
    """An admin key passes; a tenant's key is a 403, anything else a 401."""
    key = bearer_key(request.headers.get("authorization"))
    if not billing.admin_hashes:
        raise Forbidden("no admin keys are configured (set admin_keys)")
    if not key:
        raise TenantError("missing admin key: send it as 'Authorization: Bearer KEY'")
    if hash_key(key) in billing.admin_hashes:
        return
    try:
        tenants.authenticate(key)
    except TenantError:
        raise TenantError("invalid admin key", code="invalid_api_key") from None
    raise Forbidden("this endpoint needs an admin key, not a tenant's key")


def build_billing_router(billing: Billing, front: FrontEnd) -> APIRouter:
    router = APIRouter()
    _admin_routes(router, billing, front.tenants)
    _content_routes(router, billing, front)
    return router


def _admin_routes(router: APIRouter, billing: Billing, tenants: TenantRegistry) -> None:
    @router.get("/admin/billing/export", summary="Export one tenant's ledger records (admin)")
    async def export(
        request: Request,
        tenant: str,
        start: str = Query(alias="from"),
        end: str = Query(alias="to"),
        format: str = "jsonl",
    ) -> Response:
        try:
            check_admin(billing, tenants, request)
            if format not in FORMATS:
                raise InvalidRequest(
                    f"format must be one of {', '.join(FORMATS)}, got {format!r}", param="format"
                )
            lo, hi = instant(start, "from"), instant(end, "to")
            if lo is not None and hi is not None and hi <= lo:
                raise InvalidRequest("'to' must be after 'from'", param="to")
            records = await billing.records(tenant, lo, hi)
            headers = {"x-kvgate-records": str(len(records))}
            if format == "parquet":
                headers["content-disposition"] = f'attachment; filename="{tenant}.parquet"'
            try:
                data = encode(records, format)
            except FormatUnavailable as exc:
                raise InvalidRequest(str(exc), param="format") from None
            return Response(data, media_type=MEDIA_TYPES[format], headers=headers)
        except GatewayError as err:
            return to_http(err)

    @router.get("/admin/billing/summary", summary="Per-tenant billing totals (admin)")
    async def summary(
        request: Request,
        tenant: str | None = None,
        start: str | None = Query(default=None, alias="from"),
        end: str | None = Query(default=None, alias="to"),
    ) -> Response:
        try:
            check_admin(billing, tenants, request)
            lo, hi = instant(start, "from"), instant(end, "to")
            return JSONResponse(summarize(await billing.records(tenant, lo, hi)))
        except GatewayError as err:
            return to_http(err)


def _content_routes(router: APIRouter, billing: Billing, front: FrontEnd) -> None:
    tenants = front.tenants
    contents = ExplicitContents(billing)

    def tenant_of(request: Request) -> Tenant:
        tenant = tenants.authenticate(bearer_key(request.headers.get("authorization")))
        contents.check_tenant(tenant)
        return tenant

    @router.post("/v1/cached_contents", summary="Create an explicit cached content")
    async def create(request: Request) -> Response:
        try:
            tenant = tenant_of(request)
            body = load_json_object(await front.read(request))
            unknown = set(body) - CREATE_FIELDS
            if unknown:
                raise InvalidRequest(f"unknown field(s): {', '.join(sorted(unknown))}")
            synthetic = {
                k: body[k]
                for k in ("model", "messages", "tools", "user", "prompt_cache_key")
                if k in body
            }
            parsed = parse_chat(
                orjson.dumps({**synthetic, "max_tokens": 1}), front.max_prompt_bytes
            )
            prepared = contents.prepare_creation(parsed, tenant, body)
            opened = await front.pipeline.open(prepared, tenant)
            if isinstance(opened, Passthrough):
                return Response(
                    opened.body, status_code=opened.status, media_type="application/json"
                )
            await opened.complete()
            pending = prepared.billing
            if pending is None or pending.created is None:
                raise UpstreamError("the engine returned no usage: the content was not created")
            await contents.created(pending.created)
            return JSONResponse(object_json(pending.created))
        except BillingError as exc:
            return to_http(InvalidRequest(str(exc)))
        except GatewayError as err:
            return to_http(err)

    @router.get("/v1/cached_contents/{object_id}", summary="Read an explicit cached content")
    async def read(request: Request, object_id: str) -> Response:
        try:
            tenant = tenant_of(request)
            return JSONResponse(object_json(await contents.find(tenant, object_id, contents.now())))
        except GatewayError as err:
            return to_http(err)

    @router.patch("/v1/cached_contents/{object_id}", summary="Extend an explicit cached content")
    async def update(request: Request, object_id: str) -> Response:
        try:
            tenant = tenant_of(request)
            body = load_json_object(await front.read(request))
            obj, charge = await contents.extend(tenant, object_id, body)
            return JSONResponse({**object_json(obj), "rent": plain(charge.rent)})
        except GatewayError as err:
            return to_http(err)

    @router.delete("/v1/cached_contents/{object_id}", summary="Delete an explicit cached content")
    async def delete(request: Request, object_id: str) -> Response:
        try:
            tenant = tenant_of(request)
            _, charge = await contents.delete(tenant, object_id)
            return JSONResponse({"id": object_id, "deleted": True, "rent": plain(charge.rent)})
        except GatewayError as err:
            return to_http(err)
