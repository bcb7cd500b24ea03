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
Creating one runs its prefill on a replica (max_tokens 1), so the KV exists and the engine
counts its tokens exactly.
"""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

import orjson
from fastapi import APIRouter, Query, Request
from starlette.responses import JSONResponse, Response

from gateway.api.body import load_json_object
from gateway.api.context import FrontEnd
from gateway.api.openai.parse import parse_chat
from gateway.billing.export import FORMATS, MEDIA_TYPES, encode, summarize
from gateway.billing.pending import Pending, profile_for
from gateway.billing.pricing.model import BillingError, CachedContent
from gateway.billing.pricing.money import dec, iso, parse_instant, plain
from gateway.billing.pricing.rules import DEFAULT_EXPLICIT_TTL_S
from gateway.billing.service import Billing
from gateway.errors import (
    Forbidden,
    GatewayError,
    InvalidRequest,
    TenantError,
    UpstreamError,
    to_http,
)
from gateway.pipeline.forwarder import Passthrough
from gateway.request.tenant import Tenant
from gateway.tenancy.registry import bearer_key, hash_key

MAX_LIFETIME_S = Decimal(366 * 86400)
"""An explicit cached content lives at most a year: beyond that a TTL is a typo, and the rent
charged up front through the expiry would be absurd."""


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"


def _instant(value: str | None, name: str) -> Decimal | None:
    if value is None or value == "":
        return None
    try:
        return parse_instant(value)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param=name) from None


def _object_json(obj: CachedContent) -> dict[str, Any]:
    return {
        "id": obj.object_id,
        "object": "cached_content",
        "model": obj.payload.get("model", obj.model),
        "price_model": obj.model,
        "tokens": obj.num_tokens,
        "create_time": iso(obj.created),
        "expire_time": iso(obj.expires),
    }


def build_billing_router(billing: Billing, front: FrontEnd) -> APIRouter:
    router = APIRouter()
    tenants = front.tenants
    meter = billing.meter

    def admin(request: Request) -> None:
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

    @router.get("/admin/billing/export", summary="Export one tenant's ledger records (admin)")
    async def export(
        request: Request,
        tenant: str,
        start: str = Query(alias="from"),
        end: str = Query(alias="to"),
        format: str = "jsonl",
    ) -> Response:
        try:
            admin(request)
            if format not in FORMATS:
                raise InvalidRequest(
                    f"format must be one of {', '.join(FORMATS)}, got {format!r}", param="format"
                )
            lo = _instant(start, "from")
            hi = _instant(end, "to")
            if lo is not None and hi is not None and hi <= lo:
                raise InvalidRequest("'to' must be after 'from'", param="to")
            records = await billing.records(tenant, lo, hi)
            headers = {"x-kvgate-records": str(len(records))}
            if format == "parquet":
                headers["content-disposition"] = f'attachment; filename="{tenant}.parquet"'
            return Response(
                encode(records, format), media_type=MEDIA_TYPES[format], headers=headers
            )
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
            admin(request)
            lo = _instant(start, "from")
            hi = _instant(end, "to")
            return JSONResponse(summarize(await billing.records(tenant, lo, hi)))
        except GatewayError as err:
            return to_http(err)

    # -- explicit cached contents --------------------------------------------------------------
    def tenant_of(request: Request) -> Tenant:
        tenant = tenants.authenticate(bearer_key(request.headers.get("authorization")))
        profile = profile_for(billing.settings, tenant)
        if profile != "google_explicit":
            raise InvalidRequest(
                f"explicit cached contents need the google_explicit billing profile; this "
                f"tenant's is {profile!r}"
            )
        return tenant

    def expiry(body: dict[str, Any], now: Decimal, default: Decimal | None) -> Decimal:
        ttl, expire = body.get("ttl_s"), body.get("expire_time")
        if ttl is not None and expire is not None:
            raise InvalidRequest("give either 'ttl_s' or 'expire_time', not both", param="ttl_s")
        if ttl is not None:
            if isinstance(ttl, bool) or not isinstance(ttl, int | float | str):
                raise InvalidRequest("'ttl_s' must be a number of seconds", param="ttl_s")
            try:
                seconds = dec(ttl)
            except ValueError as exc:
                raise InvalidRequest(f"'ttl_s': {exc}", param="ttl_s") from None
            if not 0 < seconds <= MAX_LIFETIME_S:
                raise InvalidRequest(
                    f"'ttl_s' must be positive and at most {MAX_LIFETIME_S} s", param="ttl_s"
                )
            return now + seconds
        if expire is not None:
            if not isinstance(expire, str):
                raise InvalidRequest(
                    "'expire_time' must be an ISO-8601 string", param="expire_time"
                )
            when = _instant(expire, "expire_time")
            assert when is not None
            if not now < when <= now + MAX_LIFETIME_S:
                raise InvalidRequest(
                    "'expire_time' must be in the future and within a year", param="expire_time"
                )
            return when
        if default is None:
            raise InvalidRequest("give 'ttl_s' or 'expire_time'", param="ttl_s")
        return now + default

    async def op_done(kind: str, obj: CachedContent, charge: Any, now: Decimal) -> None:
        record = meter.op_record(kind, "op-" + uuid.uuid4().hex, obj, charge, now)
        await billing.wal.append(record)
        meter.save_contents()

    @router.post("/v1/cached_contents", summary="Create an explicit cached content")
    async def create(request: Request) -> Response:
        try:
            tenant = tenant_of(request)
            body = load_json_object(await request.body())
            unknown = set(body) - {"model", "messages", "tools", "ttl_s", "expire_time"}
            if unknown:
                raise InvalidRequest(f"unknown field(s): {', '.join(sorted(unknown))}")
            synthetic = {k: body[k] for k in ("model", "messages", "tools") if k in body}
            parsed = parse_chat(
                orjson.dumps({**synthetic, "max_tokens": 1}), front.max_prompt_bytes
            )
            now = meter.clock.now()
            expires = expiry(body, now, DEFAULT_EXPLICIT_TTL_S)
            prepared = meter.prepare_sync(parsed, tenant)
            pending = prepared.billing
            assert isinstance(pending, Pending)
            if pending.price_model is None:
                raise InvalidRequest(f"model {parsed.model!r} has no price under google_explicit")
            pending.op = "cache.create"
            pending.create = {
                "id": "cc-" + uuid.uuid4().hex[:24],
                "expires": expires,
                "messages": body["messages"],
                "tools": body.get("tools"),
            }
            opened = await front.pipeline.open(prepared, tenant)
            if isinstance(opened, Passthrough):
                return Response(
                    opened.body, status_code=opened.status, media_type="application/json"
                )
            await opened.complete()
            if pending.created is None:
                raise UpstreamError("the engine returned no usage: the content was not created")
            await meter.publish_object(pending.created)
            out = _object_json(pending.created)
            return JSONResponse(out)
        except BillingError as exc:
            return to_http(InvalidRequest(str(exc)))
        except GatewayError as err:
            return to_http(err)

    async def find(tenant: Tenant, object_id: str, now: Decimal) -> CachedContent:
        await meter.sync_object(object_id)
        try:
            return meter.ledger("google_explicit").content(tenant.name, object_id, now)
        except BillingError as exc:
            raise NotFound(str(exc), param="id") from None

    @router.get("/v1/cached_contents/{object_id}", summary="Read an explicit cached content")
    async def read(request: Request, object_id: str) -> Response:
        try:
            tenant = tenant_of(request)
            return JSONResponse(_object_json(await find(tenant, object_id, meter.clock.now())))
        except GatewayError as err:
            return to_http(err)

    @router.patch("/v1/cached_contents/{object_id}", summary="Extend an explicit cached content")
    async def update(request: Request, object_id: str) -> Response:
        try:
            tenant = tenant_of(request)
            body = load_json_object(await request.body())
            now = meter.clock.now()
            obj = await find(tenant, object_id, now)
            expires = expiry(body, now, None)
            try:
                charge = meter.ledger("google_explicit").update_content(
                    tenant.name, object_id, now, expires
                )
            except BillingError as exc:
                raise InvalidRequest(str(exc)) from None
            await op_done("cache.update", obj, charge, now)
            await meter.publish_object(obj)
            return JSONResponse({**_object_json(obj), "rent": plain(charge.rent)})
        except GatewayError as err:
            return to_http(err)

    @router.delete("/v1/cached_contents/{object_id}", summary="Delete an explicit cached content")
    async def delete(request: Request, object_id: str) -> Response:
        try:
            tenant = tenant_of(request)
            now = meter.clock.now()
            obj = await find(tenant, object_id, now)
            charge = meter.ledger("google_explicit").delete_content(tenant.name, object_id, now)
            await op_done("cache.delete", obj, charge, now)
            await meter.publish_object(obj)
            return JSONResponse({"id": object_id, "deleted": True, "rent": plain(charge.rent)})
        except GatewayError as err:
            return to_http(err)

    return router
