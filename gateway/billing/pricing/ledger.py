"""The tenant-visible cache ledger: one profile's rules applied to a stream of requests.

`CacheLedger` is pure (no I/O, no clock of its own): `kvgate billing simulate` feeds it events
from a file, the live meter feeds it exchanges. It keeps, per scope (isolation scope, model:
the tenant, or one end user of a `user`-scoped tenant, see `MeteredRequest.scope`), the
entries the contract says exist — whatever the replicas physically hold — and the explicit
cached-content objects with their rent.

Two steps per request, so the live meter can decide when the entry becomes visible (the first
token) and price when the engine's exact token counts arrive (the usage):

    plan = ledger.admit(request)                  # lookup, writes, refreshes: mutates state
    charge = ledger.bill(request, plan, ends, N)  # token arithmetic on exact counts: pure

`price(request)` does both with the request's own counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from decimal import Decimal

from gateway.billing.pricing.model import (
    BillingError,
    CachedContent,
    Charge,
    Entry,
    MeteredRequest,
    Plan,
)
from gateway.billing.pricing.money import MILLION, ZERO
from gateway.billing.pricing.prices import PROFILES, ModelPrice, PriceTable
from gateway.billing.pricing.rules import (
    DEEPSEEK_UNIT_TOKENS,
    DEFAULT_GOOGLE_MIN_TOKENS,
    DEFAULT_OPENAI_MIN_TOKENS,
    LEGACY_GRANULARITY,
    SPECS,
    ProfileOptions,
    peak_multiplier,
    plan_anthropic,
    plan_explicit,
    plan_openai,
    plan_prefix,
)

SWEEP_EVERY = 4096
"""Dead entries are dropped every 4,096 admissions: O(entries) each time, amortized O(1)."""
SWEEP_SLACK_S = Decimal(3600)
"""The live meter admits in first-token order, so a later admission may carry an earlier start:
sweep only what was dead an hour before the latest start."""


class CacheLedger:
    """The contract's cache state for one billing profile.

    Invariants: entries live in the scope (isolation scope, model) that wrote them and are never
    read from another; a request's plan is computed against the entries as of its start; explicit
    objects belong to one tenant and bill creation, then rent until min(expiry, deletion).
    """

    def __init__(
        self, profile: str, prices: PriceTable, options: ProfileOptions | None = None
    ) -> None:
        if profile not in PROFILES:
            raise ValueError(f"unknown billing profile {profile!r}; valid: {', '.join(PROFILES)}")
        self.profile = profile
        self.spec = SPECS[profile]
        self.prices = prices
        self.options = options or ProfileOptions()
        self.scopes: dict[tuple[str, str], dict[object, Entry]] = {}
        self.objects: dict[str, CachedContent] = {}
        self._admissions = 0

    # -- requests ------------------------------------------------------------------------------
    def row(self, model: str) -> ModelPrice:
        try:
            return self.prices.lookup(self.profile, model)
        except ValueError as exc:
            raise BillingError(str(exc)) from None

    def admit(self, req: MeteredRequest) -> Plan:
        """Look the request up and update the entries (writes, refreshes). Raises BillingError
        for what the profile refuses (too many breakpoints, TTL order, unknown object)."""
        row = self.row(req.model)
        entries = self.scopes.setdefault((req.scope_key, req.model), {})
        options = self.options
        profile = self.profile
        if profile == "anthropic":
            plan = plan_anthropic(req, entries, row, options)
        elif profile == "openai":
            plan = plan_openai(req, entries, row, options)
        elif profile == "openai_legacy":
            minimum = row.min_tokens if row.min_tokens is not None else DEFAULT_OPENAI_MIN_TOKENS
            plan = plan_prefix(
                req,
                entries,
                options.legacy_ttl_s,
                granularity=LEGACY_GRANULARITY,
                min_hit_tokens=minimum,
            )
        elif profile == "google_implicit":
            minimum = row.min_tokens if row.min_tokens is not None else DEFAULT_GOOGLE_MIN_TOKENS
            plan = plan_prefix(
                req, entries, options.google_implicit_ttl_s, granularity=1, min_hit_tokens=minimum
            )
        elif profile == "google_explicit":
            plan = plan_explicit(req, self.objects)
        else:
            assert profile == "deepseek"
            by_units = options.deepseek_unit == "64"
            plan = plan_prefix(
                req,
                entries,
                options.deepseek_ttl_s,
                granularity=DEEPSEEK_UNIT_TOKENS if by_units else 1,
                min_hit_tokens=DEEPSEEK_UNIT_TOKENS if by_units else 0,
                boundaries_only=not by_units,
            )
        self._admissions += 1
        if self._admissions % SWEEP_EVERY == 0:
            self.sweep(req.start - SWEEP_SLACK_S)
        return plan

    def bill(
        self,
        req: MeteredRequest,
        plan: Plan,
        block_ends: Sequence[int] | None = None,
        num_prompt_tokens: int | None = None,
        num_output_tokens: int | None = None,
    ) -> Charge:
        """The charge of a planned request. `block_ends` (cumulative tokens per block) and the
        totals default to the request's own; ends are clamped into [0, N] and made monotone,
        so estimated positions can never bill more tokens than the prompt has."""
        n = req.num_prompt_tokens if num_prompt_tokens is None else num_prompt_tokens
        o = req.num_output_tokens if num_output_tokens is None else num_output_tokens
        raw = [b.end_tokens for b in req.blocks] if block_ends is None else list(block_ends)
        ends: list[int] = []
        for value in raw:
            ends.append(min(max(value, ends[-1] if ends else 0), n))
        if plan.read_tokens is not None:
            read = min(plan.read_tokens, n)
            covered = read
        elif plan.read_to >= 0:
            covered = ends[plan.read_to]
            read = covered // plan.granularity * plan.granularity
            if covered < plan.min_hit_tokens:
                read = 0
        else:
            read = covered = 0
        written: dict[str, int] = {}
        for tier, index in plan.writes:
            end = max(ends[index], covered)
            written[tier] = written.get(tier, 0) + end - covered
            covered = end
        uncached = n - read - sum(written.values())
        assert uncached >= 0, (n, read, written)
        return self._charge(req.model, req.start, n, uncached, read, written, o)

    def price(self, req: MeteredRequest) -> Charge:
        return self.bill(req, self.admit(req))

    def _charge(
        self,
        model: str,
        start: Decimal,
        n: int,
        uncached: int,
        read: int,
        written: dict[str, int],
        num_output_tokens: int,
        rent: Decimal = ZERO,
    ) -> Charge:
        row = self.row(model)
        multipliers = self.spec.write_multipliers
        read_price = row.read(self.spec.read_multiplier)
        m = (
            peak_multiplier(start, self.options.deepseek_holidays)
            if self.profile == "deepseek"
            else Decimal(1)
        )
        input_units = row.input * uncached + read_price * read
        for tier, tokens in written.items():
            input_units += row.input * multipliers.get(tier, Decimal(1)) * tokens
        return Charge(
            num_prompt_tokens=n,
            uncached=uncached,
            read=read,
            written=dict(written),
            num_output_tokens=num_output_tokens,
            write_multipliers={tier: multipliers.get(tier, Decimal(1)) for tier in written},
            read_price=read_price,
            input_price=row.input,
            output_price=row.output,
            peak_multiplier=m,
            input_cost=input_units * m / MILLION,
            output_cost=row.output * num_output_tokens * m / MILLION,
            rent=rent,
        )

    # -- explicit cached contents (google_explicit) -------------------------------------------
    def _require_explicit(self) -> None:
        if self.profile != "google_explicit":
            raise BillingError(
                f"explicit cached contents need the google_explicit profile, not {self.profile!r}"
            )

    def create_content(self, obj: CachedContent) -> Charge:
        """Register an object: creation billed as standard input (w = 1), rent through its
        expiry (corrected by `update_content` / `delete_content`)."""
        self._require_explicit()
        self.row(obj.model)
        if obj.object_id in self.objects:
            raise BillingError(f"cached content {obj.object_id!r} already exists")
        if obj.expires <= obj.created:
            raise BillingError("a cached content's expiry must come after its creation")
        self.objects[obj.object_id] = obj
        rent = self.row(obj.model).rent_between(obj.num_tokens, obj.created, obj.expires)
        return self._charge(obj.model, obj.created, obj.num_tokens, obj.num_tokens, 0, {}, 0, rent)

    def content(
        self, tenant: str, object_id: str, t: Decimal, scope: str | None = None
    ) -> CachedContent:
        """A live object of `tenant`; with `scope`, only one that scope made (a prompt may read
        only its own scope's objects; the tenant manages all of its own)."""
        obj = self.objects.get(object_id)
        if obj is None or obj.tenant != tenant or (scope is not None and obj.scope_key != scope):
            raise BillingError(f"no cached content {object_id!r} for this tenant")
        if not obj.live(t):
            raise BillingError(f"cached content {object_id!r} has expired or was deleted")
        return obj

    def update_content(self, tenant: str, object_id: str, t: Decimal, expires: Decimal) -> Charge:
        """Move a live object's expiry (only updates extend a lifetime): rent for the change."""
        self._require_explicit()
        obj = self.content(tenant, object_id, t)
        if expires <= t:
            raise BillingError("the new expiry must be in the future (delete to end it now)")
        rent = self.row(obj.model).rent_between(obj.num_tokens, obj.expires, expires)
        obj.expires = expires
        return self._charge(obj.model, t, 0, 0, 0, {}, 0, rent)

    def delete_content(self, tenant: str, object_id: str, t: Decimal) -> Charge:
        """End a live object now: the rent charged through its expiry is refunded from t."""
        self._require_explicit()
        obj = self.content(tenant, object_id, t)
        rent = self.row(obj.model).rent_between(obj.num_tokens, obj.expires, t)
        obj.deleted = t
        return self._charge(obj.model, t, 0, 0, 0, {}, 0, rent)

    # -- housekeeping --------------------------------------------------------------------------
    def sweep(self, now: Decimal) -> int:
        """Drop entries that can never be live again; returns how many were dropped."""
        dropped = 0
        for entries in self.scopes.values():
            dead = [k for k, e in entries.items() if not e.alive(now)]
            for key in dead:
                del entries[key]
            dropped += len(dead)
        return dropped

    def num_entries(self) -> int:
        return sum(len(e) for e in self.scopes.values())
