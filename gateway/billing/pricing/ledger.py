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

Memory is bounded by `max_entries` when given: past it, the entries that can never be live
again go first (with no slack for late admissions), then those that expire soonest, down to
90% of the bound. An entry dropped while live costs its tenant a write where the contract gives
a read (a provider that evicts early does the same); `num_evicted` counts them.
"""

from __future__ import annotations

import itertools
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
"""Dead entries are dropped every 4,096 admissions, or every entries/4 when there are more:
O(entries) each time, amortized O(1) (at most 4 entries visited per admission)."""
SWEEP_SLACK_S = Decimal(3600)
"""The live meter admits in first-token order, so a later admission may carry an earlier start:
sweep only what was dead an hour before the latest start."""
BOUND_CHECK_EVERY = 256
"""The entry count is checked every 256 admissions (a sum of dict sizes, one per scope; every
1/16th of a smaller bound): the bound is passed by at most that many requests' entries."""
BOUND_SAMPLE = 2_048
"""Entries sampled to find the expiry that leaves 90% of the bound (~2% error on the cut)."""
BOUND_LOW_WATER = Decimal("0.9")
"""At the bound, entries are dropped down to 90% of it, so the O(entries) pass is paid once per
10% of the bound's worth of new entries, not on every admission."""


class CacheLedger:
    """The contract's cache state for one billing profile.

    Invariants: entries live in the scope (isolation scope, model) that wrote them and are never
    read from another; a request's plan is computed against the entries as of its start; explicit
    objects belong to one tenant and bill creation, then rent until min(expiry, deletion).
    """

    def __init__(
        self,
        profile: str,
        prices: PriceTable,
        options: ProfileOptions | None = None,
        max_entries: int | None = None,
    ) -> None:
        if profile not in PROFILES:
            raise ValueError(f"unknown billing profile {profile!r}; valid: {', '.join(PROFILES)}")
        if max_entries is not None and max_entries < 1:
            raise ValueError("max_entries must be at least 1 (or None: unbounded)")
        self.max_entries = max_entries
        self._check_every = (
            max(1, min(BOUND_CHECK_EVERY, max_entries // 16)) if max_entries else BOUND_CHECK_EVERY
        )
        self.num_evicted = 0
        """Live entries dropped to keep the bound (each may cost a tenant a write)."""
        self.num_bound_sweeps = 0
        self.profile = profile
        self.spec = SPECS[profile]
        self.prices = prices
        self.options = options or ProfileOptions()
        self.scopes: dict[tuple[str, str], dict[object, Entry]] = {}
        self.objects: dict[str, CachedContent] = {}
        self._admissions = 0
        self._next_sweep = SWEEP_EVERY

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
        if self._admissions >= self._next_sweep:
            self.sweep(req.start - SWEEP_SLACK_S)
            self._next_sweep = self._admissions + max(SWEEP_EVERY, self.num_entries() // 4)
        if self.max_entries is not None and self._admissions % self._check_every == 0:
            self.bound(req.start)
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

    def bound(self, now: Decimal) -> int:
        """Keep the entries within `max_entries` (see the module docstring); returns how many
        live entries were dropped. One pass over the entries: the expiry that leaves 90% of
        the bound is estimated from a sample (every k-th entry, read at C speed), and every
        entry that expires by then — or is dead now — goes."""
        limit = self.max_entries
        total = self.num_entries()
        if limit is None or total <= limit:
            return 0
        self.num_bound_sweeps += 1
        keep = int(limit * BOUND_LOW_WATER)
        stride = max(1, total // BOUND_SAMPLE)
        sample = sorted(
            e.last_use + e.ttl_s
            for entries in self.scopes.values()
            for e in itertools.islice(entries.values(), 0, None, stride)
        )
        cut = sample[min(len(sample) - 1, (total - keep) * len(sample) // total)]
        threshold = max(cut, now)
        evicted = 0
        for entries in self.scopes.values():
            gone = [k for k, e in entries.items() if e.last_use + e.ttl_s <= threshold]
            for key in gone:
                entry = entries.pop(key)
                evicted += entry.alive(now)
        self.num_evicted += evicted
        return evicted
