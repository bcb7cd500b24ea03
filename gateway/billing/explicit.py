"""Explicit cached contents (the google_explicit profile): the domain side of
`/v1/cached_contents` — who may use them, their lifetimes, and the ledger operations with their
durable records. The HTTP routes (`gateway.api.billing`) parse and answer; creation's prefill
runs through the pipeline like any request (`prepare_creation`, then the meter prices it).
"""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

from gateway.billing.meter import BillingUnavailable
from gateway.billing.pending import BilledRequest, Pending, profile_for
from gateway.billing.pricing.model import BillingError, CachedContent, Charge
from gateway.billing.pricing.money import dec, iso, parse_instant
from gateway.billing.pricing.rules import DEFAULT_EXPLICIT_TTL_S
from gateway.billing.service import Billing
from gateway.billing.wal import WalUnavailable
from gateway.errors import GatewayError, InvalidRequest
from gateway.request.parsed import ParsedRequest
from gateway.request.tenant import Tenant

MAX_LIFETIME_S = Decimal(366 * 86400)
"""An explicit cached content lives at most a year: beyond that a TTL is a typo, and the rent
charged up front through the expiry would be absurd."""
CREATE_FIELDS = frozenset(
    {"model", "messages", "tools", "ttl_s", "expire_time", "user", "prompt_cache_key"}
)
"""`user` / `prompt_cache_key` name the end user of a `user`-scoped tenant: the object is that
end user's (only its prompts may read it; the tenant manages it)."""
PROFILE = "google_explicit"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"


def instant(value: str | None, name: str) -> Decimal | None:
    if value is None or value == "":
        return None
    try:
        return parse_instant(value)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param=name) from None


def object_json(obj: CachedContent) -> dict[str, Any]:
    return {
        "id": obj.object_id,
        "object": "cached_content",
        "model": obj.payload.get("model", obj.model),
        "price_model": obj.model,
        "tokens": obj.num_tokens,
        "create_time": iso(obj.created),
        "expire_time": iso(obj.expires),
    }


def expiry(body: dict[str, Any], now: Decimal, default: Decimal | None) -> Decimal:
    """When a content expires: `ttl_s` from now, or `expire_time`, or `default` from now."""
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
            raise InvalidRequest("'expire_time' must be an ISO-8601 string", param="expire_time")
        when = instant(expire, "expire_time")
        assert when is not None
        if not now < when <= now + MAX_LIFETIME_S:
            raise InvalidRequest(
                "'expire_time' must be in the future and within a year", param="expire_time"
            )
        return when
    if default is None:
        raise InvalidRequest("give 'ttl_s' or 'expire_time'", param="ttl_s")
    return now + default


class ExplicitContents:
    def __init__(self, billing: Billing) -> None:
        self.billing = billing
        self.meter = billing.meter

    def check_tenant(self, tenant: Tenant) -> None:
        profile = profile_for(self.billing.settings, tenant)
        if profile != PROFILE:
            raise InvalidRequest(
                f"explicit cached contents need the {PROFILE} billing profile; this tenant's "
                f"is {profile!r}"
            )

    def now(self) -> Decimal:
        return self.meter.clock.now()

    def prepare_creation(
        self, parsed: ParsedRequest, tenant: Tenant, body: dict[str, Any]
    ) -> BilledRequest:
        """The creation's prefill as a request the pipeline can serve; the meter creates the
        object when its usage arrives (`Pending.created`)."""
        expires = expiry(body, self.now(), DEFAULT_EXPLICIT_TTL_S)
        prepared = self.meter.prepare_sync(parsed, tenant)
        pending = prepared.billing
        assert isinstance(pending, Pending)
        if pending.price_model is None:
            raise InvalidRequest(f"model {parsed.model!r} has no price under {PROFILE}")
        pending.op = "cache.create"
        pending.create = {
            "id": "cc-" + uuid.uuid4().hex[:24],
            "expires": expires,
            "messages": body["messages"],
            "tools": body.get("tools"),
        }
        return prepared

    async def created(self, obj: CachedContent) -> None:
        await self.meter.publish_object(obj)

    async def find(self, tenant: Tenant, object_id: str, now: Decimal) -> CachedContent:
        await self.meter.sync_object(object_id)
        try:
            return self.meter.ledger(PROFILE).content(tenant.name, object_id, now)
        except BillingError as exc:
            raise NotFound(str(exc), param="id") from None

    async def extend(
        self, tenant: Tenant, object_id: str, body: dict[str, Any]
    ) -> tuple[CachedContent, Charge]:
        now = self.now()
        obj = await self.find(tenant, object_id, now)
        expires = expiry(body, now, None)
        try:
            charge = self.meter.ledger(PROFILE).update_content(tenant.name, object_id, now, expires)
        except BillingError as exc:
            raise InvalidRequest(str(exc)) from None
        await self._done("cache.update", obj, charge, now)
        return obj, charge

    async def delete(self, tenant: Tenant, object_id: str) -> tuple[CachedContent, Charge]:
        now = self.now()
        obj = await self.find(tenant, object_id, now)
        charge = self.meter.ledger(PROFILE).delete_content(tenant.name, object_id, now)
        await self._done("cache.delete", obj, charge, now)
        return obj, charge

    async def _done(self, kind: str, obj: CachedContent, charge: Charge, now: Decimal) -> None:
        """The operation's durable record, the local snapshot, then every other gateway."""
        record = self.meter.op_record(kind, "op-" + uuid.uuid4().hex, obj, charge, now)
        try:
            await self.billing.wal.append(record)
        except WalUnavailable as exc:
            raise BillingUnavailable(str(exc)) from None
        self.meter.spent(obj.tenant, charge, without_caching=False)
        self.meter.save_contents()
        await self.meter.publish_object(obj)
