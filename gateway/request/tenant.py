"""A tenant as a request sees it: its name, its policy and the salt of its isolation scope.

The salt is derived by `gateway.tenancy` (HMAC of the server secret and the scope), never taken
from the client; the per-request copy of a `user`-scoped tenant carries its end user's salt.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

SCOPE_TENANT = "tenant"
"""Every key of the tenant shares one cache scope (the default)."""
SCOPE_USER = "user"
"""Each end user of the tenant (the request's `user`, else its `prompt_cache_key`) has its own."""
SCOPES = (SCOPE_TENANT, SCOPE_USER)
BILLING_PROFILES = (
    "anthropic",
    "openai",
    "openai_legacy",
    "google_implicit",
    "google_explicit",
    "deepseek",
)
"""The providers' rules a tenant can be billed by (gateway.billing, docs/billing.md#profiles):
named here, with the rest of a tenant's vocabulary, so settings and the tenants file can check a
name without importing billing."""
MAX_WEIGHT = 1000.0
"""A scope's weight is at most 1000× the smallest (0, 1000]: beyond it the lighter scope's
share is below one request in a thousand, i.e. a band, not a weight."""
MAX_PRIORITY = 1000
"""`priority` values are integers within ±1000 (vLLM takes any integer; a bound keeps the
bands an operator configures readable and the number of bands small)."""
TENANT_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
"""Names travel in salts, Redis keys (inside a {hash tag}) and logs: no '/', ':', '{' or space."""


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """What a tenant may do. `None` is no limit; empty `models` allows every served model."""

    scope: str = SCOPE_TENANT
    billing_profile: str | None = None
    models: frozenset[str] = frozenset()
    requests_per_min: int | None = None
    tokens_per_min: int | None = None
    max_prompt_tokens: int | None = None
    max_inflight: int | None = None
    """Requests this tenant may have in flight at once in one gateway process (None: the
    gateway's `tenant_max_inflight`)."""
    trusted_tracing: bool = False
    """Whether the tenant's `traceparent` decides if its requests are traced. Off (the default),
    a client's sampled flag can only opt a request out: the gateway samples at its configured
    ratio, so no tenant can make it trace (and export) every request."""
    # -- fair flow control (issue 43; docs/flow-control.md) --
    weight: float = 1.0
    """The scope's share of a saturated fleet relative to the others in its band."""
    priority: int = 0
    """Its requests' band when they name none (vLLM's convention: lower is served first)."""
    priority_range: tuple[int, int] | None = None
    """The `priority` values its requests may ask for (inclusive); None: only `priority`."""
    route_receipts: bool = False
    """Whether its answers carry the `x-kvgate-route` receipt (the replica chosen, its match,
    the runner-up and their scores: the fleet's names and load, so an operator's choice)."""

    def __post_init__(self) -> None:
        if self.scope not in SCOPES:
            raise ValueError(f"unknown isolation scope {self.scope!r}; choose one of {SCOPES}")
        if not 0 < self.weight <= MAX_WEIGHT:
            raise ValueError(f"weight must be a number in (0, {MAX_WEIGHT:g}], got {self.weight}")
        low, high = self.allowed_priorities
        if not -MAX_PRIORITY <= low <= high <= MAX_PRIORITY:
            raise ValueError(
                f"priority_range must be [low, high] with {-MAX_PRIORITY} <= low <= high <= "
                f"{MAX_PRIORITY}, got [{low}, {high}]"
            )
        if not low <= self.priority <= high:
            raise ValueError(f"priority {self.priority} is outside priority_range [{low}, {high}]")
        for name in ("requests_per_min", "tokens_per_min", "max_prompt_tokens", "max_inflight"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive (or absent for no limit)")

    @property
    def allowed_priorities(self) -> tuple[int, int]:
        """The inclusive range of `priority` a request may name."""
        return self.priority_range or (self.priority, self.priority)


DEFAULT_POLICY = TenantPolicy()


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    salt: bytes
    cache_salt: str = ""
    """The salt as sent to the engine: its hex form (derived once, not per request)."""
    policy: TenantPolicy = DEFAULT_POLICY
    end_user: str | None = None
    """Set on the per-request copy of a `user`-scoped tenant: the salt is then that user's."""

    def __post_init__(self) -> None:
        if not self.cache_salt:
            object.__setattr__(self, "cache_salt", self.salt.hex())

    @property
    def scope(self) -> str:
        """The isolation scope's id, what per-scope state (the billing ledger, explicit cached
        contents) is keyed by: the tenant's name, or, for an end user of a `user`-scoped tenant,
        `name/` and the first 128 bits of that user's salt (no name holds a '/', and the salt is
        an HMAC of the server secret, so no client can choose a colliding scope)."""
        if self.end_user is None:
            return self.name
        return f"{self.name}/{self.salt.hex()[:32]}"


def check_tenant_name(name: str) -> str:
    if not TENANT_NAME_PATTERN.fullmatch(name):
        raise ValueError(
            f"tenant name {name!r} must be 1-63 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return name


def hash_key(key: str) -> str:
    """How an API key is kept: its SHA-256 hex digest (keys are 256-bit random strings, so a
    fast hash is enough: there is nothing to brute-force)."""
    return hashlib.sha256(key.encode()).hexdigest()
