"""What billing learned at a request's start, carried on the request itself; and the one
function that decides a tenant's billing profile.

A front end that builds its own request (the explicit-cache creation does) may hand the meter a
ready `BilledRequest`; every other request gets one from the meter's request hook.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from gateway.billing.pricing.layout import Layout
from gateway.billing.pricing.model import CachedContent
from gateway.request.parsed import ParsedRequest
from gateway.request.tenant import Tenant
from gateway.settings import Settings


def profile_for(settings: Settings, tenant: Tenant) -> str:
    """The billing profile of a tenant: its own (the tenants file's `billing_profile`), else its
    entry in the `billing_profiles` setting, else the `billing_profile` default. The one place a
    tenant's profile is decided."""
    own = tenant.policy.billing_profile
    if own is not None:
        return own
    return settings.billing_profiles.get(tenant.name, settings.billing_profile)


@dataclass(slots=True)
class Pending:
    """What billing learned at a request's start."""

    request_id: str
    tenant: str
    profile: str
    model: str
    price_model: str | None
    start: Decimal
    layout: Layout
    max_tokens: int | None = None
    cached_content: CachedContent | None = None
    counted: list[int] | None = None
    """Cumulative token counts per block, when a tokenizer is configured."""
    op: str = "request"
    """"request", or "cache.create" for the prefill that creates an explicit object."""
    create: dict[str, Any] = field(default_factory=dict)
    created: CachedContent | None = None
    scope: str = ""
    """The request's isolation scope (`Tenant.scope`): what its ledger entries are keyed by,
    while `tenant` (the name) is who is billed."""
    admitted: bool = False
    """Admitted to the ledger (at its first token, or a fan-out leader at its BlockStored)."""
    queue_s: float | None = None
    """How long it waited in flow control's queue before its start (set when it is routed)."""


@dataclass(slots=True)
class BilledRequest(ParsedRequest):
    """A parsed request with what billing learned at its start (front ends may build one)."""

    billing: Pending | None = None
