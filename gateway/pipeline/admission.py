"""The tenant's side of admission: scope, allowed models, prompt size, rate limits.

The director calls it for every request, whatever the front end (`Director._admit`):

1. Scope: a `user`-scoped tenant needs an end user — the request's `user`, else its
   `prompt_cache_key` — and the request then carries that user's salt (a 400 without one: a
   silent tenant-wide fallback would share the cache between the tenant's users).
2. Model: a tenant with an allow-list may use only those models (403 naming them).
3. Size: the estimated prompt tokens must not exceed the tenant's `max_prompt_tokens` (400).
   A request hook that grows the prompt (billing expands an explicit cached content) has the
   size checked again on what it made, bytes (`max_prompt_bytes`) and tokens (`check_size`).
4. In flight: at most the tenant's `max_inflight` requests at once in this process (else the
   gateway's `tenant_max_inflight`), from here until their exchange ends (429
   `too_many_requests_in_flight`), so one tenant holding many streams cannot take every
   upstream slot from the others (`enter`).
5. Rate: requests/min and tokens/min (429 with Retry-After). The tokens charged are the
   prompt estimate plus `max_tokens` when given; the usage the engine reports settles the
   difference (`gateway.pipeline.ratelimit.TokenSettlement`, an exchange observer), so the
   bucket ends up charged with what was really used.

Checks 1-3 come before the replica checks (404/503), 4 and 5 after them, so a request that
cannot be served never spends its tenant's budget (nor does one refused for its requests in
flight).
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.errors import (
    Forbidden,
    InvalidRequest,
    ModelNotFound,
    QuotaExceeded,
    TooManyInFlight,
)
from gateway.pipeline.ratelimit import Limits, RateLimiter
from gateway.request.parsed import ParsedRequest
from gateway.request.tenant import SCOPE_USER, Tenant
from gateway.tenancy.registry import TenantRegistry

END_USER_FIELDS = ("user", "prompt_cache_key")
"""Where a `user`-scoped tenant's end user is named, in order of preference: `user` names the
person; `prompt_cache_key` (OpenAI's routing hint) stands in when it is the only one given."""


def end_user(parsed: ParsedRequest) -> str | None:
    for name in END_USER_FIELDS:
        value = parsed.body.get(name)
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise InvalidRequest(f"'{name}' must be a string", param=name)
        return value
    return None


def output_budget(parsed: ParsedRequest) -> int:
    """The output tokens the request may generate, when it says (else 0: settled on usage)."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = parsed.body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return 0


class Admission:
    """Per-tenant admission: the checks, the count in flight, then the rate-limit charge.

    `num_inflight` holds a tenant only while it has a request in flight (an entry per active
    tenant, not per tenant ever seen)."""

    def __init__(
        self,
        registry: TenantRegistry | None,
        limiter: RateLimiter | None,
        max_prompt_bytes: int | None = None,
        max_inflight: int | None = None,
        is_adapter: Callable[[str], bool] | None = None,
    ) -> None:
        self.is_adapter = is_adapter
        """A LoRA adapter the tenant may not use is a 404, as one that does not exist: an
        adapter is often another tenant's fine-tune, and a 403 would confirm it is there."""
        self.registry = registry
        self.limiter = limiter
        self.max_prompt_bytes = max_prompt_bytes
        """The front ends check the prompt they parsed; this is for what a hook expanded."""
        self.max_inflight = max_inflight
        """A tenant's requests in flight at once, unless its policy says (None: no bound)."""
        self.num_inflight: dict[str, int] = {}

    def check(self, parsed: ParsedRequest, tenant: Tenant, prompt_tokens: int) -> Tenant:
        """Steps 1-3; returns the tenant as this request sees it (with its end user's salt)."""
        policy = tenant.policy
        if policy.scope == SCOPE_USER:
            user = end_user(parsed)
            if user is None:
                raise InvalidRequest(
                    f"tenant '{tenant.name}' isolates its cache per end user: send 'user' (or "
                    "'prompt_cache_key') naming the end user",
                    param="user",
                )
            assert self.registry is not None, "user scopes need the registry's secret"
            tenant = self.registry.for_end_user(tenant, user)
        if policy.models and parsed.model not in policy.models:
            if self.is_adapter is not None and self.is_adapter(parsed.model):
                raise ModelNotFound(parsed.model, sorted(policy.models))
            raise Forbidden(
                f"tenant '{tenant.name}' may not use model '{parsed.model}'; allowed: "
                + ", ".join(sorted(policy.models)),
                param="model",
                code="model_not_allowed",
            )
        self.check_tokens(tenant, prompt_tokens)
        return tenant

    def check_tokens(self, tenant: Tenant, prompt_tokens: int) -> None:
        limit = tenant.policy.max_prompt_tokens
        if limit is not None and prompt_tokens > limit:
            raise InvalidRequest(
                f"the prompt is about {prompt_tokens} tokens; tenant '{tenant.name}' may send "
                f"at most {limit}",
                param="messages",
                code="prompt_too_long",
            )

    def check_size(self, parsed: ParsedRequest, tenant: Tenant, prompt_tokens: int) -> None:
        """Step 3 again, bytes included, for a prompt a request hook expanded."""
        limit = self.max_prompt_bytes
        if limit is not None and len(parsed.rendered) > limit:
            raise InvalidRequest(
                f"the prompt is {len(parsed.rendered)} bytes with its cached content expanded; "
                f"the maximum is {limit}",
                param="messages",
                code="prompt_too_long",
            )
        self.check_tokens(tenant, prompt_tokens)

    def enter(self, tenant: Tenant) -> Callable[[], None]:
        """Step 4: count one more request in flight for the tenant, or refuse it (429 naming
        the bound); the returned function ends it (once, however often called)."""
        limit = tenant.policy.max_inflight or self.max_inflight
        name = tenant.name
        held = self.num_inflight.get(name, 0)
        if limit is not None and held >= limit:
            raise TooManyInFlight(
                f"tenant '{name}' has {held} requests in flight, as many as it may "
                f"(max_inflight {limit}); retry when one has finished"
            )
        self.num_inflight[name] = held + 1
        left = False

        def leave() -> None:
            nonlocal left
            if not left:
                left = True
                remaining = self.num_inflight[name] - 1
                if remaining:
                    self.num_inflight[name] = remaining
                else:
                    del self.num_inflight[name]

        return leave

    async def acquire(self, parsed: ParsedRequest, tenant: Tenant, prompt_tokens: int) -> int:
        """Step 5: charge the request to its tenant's buckets; returns the tokens charged."""
        policy = tenant.policy
        limits = Limits(policy.requests_per_min, policy.tokens_per_min)
        if self.limiter is None or limits.unlimited:
            return 0
        tokens = prompt_tokens + output_budget(parsed)
        if policy.tokens_per_min is not None and tokens > policy.tokens_per_min:
            raise InvalidRequest(
                f"this request needs about {tokens} tokens, more than tenant '{tenant.name}'s "
                f"whole budget of {policy.tokens_per_min} tokens per minute; it can never be "
                "admitted (shorten the prompt or lower max_tokens)",
                code="request_too_large",
            )
        wait_s = await self.limiter.acquire(tenant.name, limits, tokens)
        if wait_s > 0:
            raise QuotaExceeded(
                f"tenant '{tenant.name}' is over its rate limit "
                f"({_describe(limits)}); retry in {wait_s:.1f} s",
                retry_after_s=wait_s,
            )
        return tokens if policy.tokens_per_min is not None else 0


def _describe(limits: Limits) -> str:
    parts = []
    if limits.requests_per_min is not None:
        parts.append(f"{limits.requests_per_min} requests/min")
    if limits.tokens_per_min is not None:
        parts.append(f"{limits.tokens_per_min} tokens/min")
    return ", ".join(parts)
