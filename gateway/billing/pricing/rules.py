"""The six profiles' rules (docs/billing.md#profiles): what a request reads, writes and refreshes.

Each `plan_*` function looks a request up in its scope's entries (key → `Entry`), updates them
(writes, sliding refreshes) and returns a `Plan` in block indices; `ledger.bill` turns the plan
and token counts into a `Charge`. Only the lookup/update is here; token arithmetic is in `bill`.

Shared semantics (docs/billing.md#common-model): times are request starts; an entry is visible
from its writer's first token (so parallel identical requests each pay a write); an entry is
live while `visible_at ≤ t < last_use + ttl` (strict); reading refreshes it free. A bracketed
tag such as [A] names one of docs/billing.md#sources.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from decimal import Decimal

from gateway.billing.pricing.model import (
    TIER_SECONDS,
    BillingError,
    CachedContent,
    Entry,
    MeteredRequest,
    Plan,
)
from gateway.billing.pricing.prices import ModelPrice

Entries = MutableMapping[object, Entry]

DEFAULT_LOOKBACK_BLOCKS = 20
"""Anthropic: from each breakpoint the lookup walks back at most 20 blocks [A]."""
DEFAULT_MAX_BREAKPOINTS = 4
"""Anthropic: at most 4 breakpoints per request; more is a 400 [A]."""
DEFAULT_OPENAI_TTL_S = Decimal(1800)
"""OpenAI 5.6 keeps an entry ≥ 30 minutes after its latest write or reuse: simulate exactly 30."""
DEFAULT_OPENAI_MAX_WRITES = 4
"""OpenAI 5.6: a request makes at most 4 writes; a lookup checks the first 2 and latest 50."""
OPENAI_LOOKUP_FIRST = 2
OPENAI_LOOKUP_LATEST = 50
DEFAULT_OPENAI_MIN_TOKENS = 1024
"""OpenAI: prompts under 1,024 tokens are never cached (5.6 and legacy alike)."""
DEFAULT_LEGACY_TTL_S = Decimal(300)
"""Legacy OpenAI caches are cleared after 5–10 minutes idle: simulate 5 minutes."""
LEGACY_GRANULARITY = 128
"""Legacy OpenAI reports cached_tokens in steps of 128 [OC]."""
DEFAULT_GOOGLE_IMPLICIT_TTL_S = Decimal(300)
"""Gemini implicit hits are best effort with no published lifetime: 5 minutes (assumption)."""
DEFAULT_GOOGLE_MIN_TOKENS = 4096
"""Gemini 3.x: 4,096 tokens [P]; configure per model (min_tokens in the price table)."""
DEFAULT_EXPLICIT_TTL_S = Decimal(3600)
"""A Gemini CachedContent lives 1 hour unless a TTL or expire_time is given [G]."""
DEEPSEEK_UNIT_TOKENS = 64
"""DeepSeek's legacy cache unit: 64 tokens; content under 64 tokens is not cached [DK]."""
DEEPSEEK_UNITS = ("64", "request_boundaries")
DEFAULT_DEEPSEEK_TTL_S = Decimal(4 * 3600)
"""DeepSeek's lifetime is unpublished (best effort, on disk): several hours, 4 (assumption)."""
PEAK_WINDOWS_UTC = ((dt.time(1), dt.time(4)), (dt.time(6), dt.time(10)))
"""DeepSeek doubles all prices 01:00–04:00 and 06:00–10:00 UTC on weekdays, half-open [P]."""


@dataclass(frozen=True, slots=True)
class ProfileOptions:
    """The rules' parameters; every default is docs/billing.md's (or its stated assumption)."""

    lookback_blocks: int = DEFAULT_LOOKBACK_BLOCKS
    max_breakpoints: int = DEFAULT_MAX_BREAKPOINTS
    openai_ttl_s: Decimal = DEFAULT_OPENAI_TTL_S
    openai_max_writes: int = DEFAULT_OPENAI_MAX_WRITES
    legacy_ttl_s: Decimal = DEFAULT_LEGACY_TTL_S
    google_implicit_ttl_s: Decimal = DEFAULT_GOOGLE_IMPLICIT_TTL_S
    deepseek_unit: str = "64"
    deepseek_ttl_s: Decimal = DEFAULT_DEEPSEEK_TTL_S
    deepseek_holidays: frozenset[dt.date] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.deepseek_unit not in DEEPSEEK_UNITS:
            raise ValueError(
                f"deepseek unit {self.deepseek_unit!r}; choose one of {', '.join(DEEPSEEK_UNITS)}"
            )
        if self.lookback_blocks < 0 or self.max_breakpoints < 1 or self.openai_max_writes < 1:
            raise ValueError("lookback ≥ 0, max breakpoints ≥ 1 and max writes ≥ 1")


@dataclass(frozen=True, slots=True)
class ProfileSpec:
    """A profile's constants: read multiplier default, write premiums per tier, TTL tiers."""

    name: str
    read_multiplier: Decimal
    write_multipliers: dict[str, Decimal]
    """Tier → w for tiers that carry a write premium (w = 1 profiles have none)."""
    default_tier: str | None
    """The tier of a breakpoint that names no TTL (None: the profile has no breakpoints)."""


SPECS: dict[str, ProfileSpec] = {
    "anthropic": ProfileSpec(
        "anthropic", Decimal("0.1"), {"5m": Decimal("1.25"), "1h": Decimal("2.0")}, "5m"
    ),
    "openai": ProfileSpec(
        "openai", Decimal("0.1"), {"30m": Decimal("1.25"), "12h": Decimal("2.5")}, "30m"
    ),
    "openai_legacy": ProfileSpec("openai_legacy", Decimal("0.5"), {}, None),
    "google_implicit": ProfileSpec("google_implicit", Decimal("0.1"), {}, None),
    "google_explicit": ProfileSpec("google_explicit", Decimal("0.1"), {}, None),
    "deepseek": ProfileSpec("deepseek", Decimal("0.02"), {}, None),
}


def peak_multiplier(start: Decimal, holidays: frozenset[dt.date]) -> Decimal:
    """DeepSeek's m(t): 2 inside a weekday peak window (by request start, half-open), else 1."""
    from gateway.billing.pricing.money import to_datetime

    moment = to_datetime(start)
    if moment.weekday() >= 5 or moment.date() in holidays:
        return Decimal(1)
    clock = moment.time()
    for lo, hi in PEAK_WINDOWS_UTC:
        if lo <= clock < hi:
            return Decimal(2)
    return Decimal(1)


def translate_mark(profile: str, ttl: str | None, default: str | None = None) -> str | None:
    """A segment's cache mark under the target profile: Anthropic takes its TTL as given
    (validated by the rules); OpenAI keeps 30m/12h and maps any other mark to an explicit
    breakpoint with `default` (the request's lifetime, else the profile's); prefix-caching
    profiles have no breakpoints."""
    if ttl is None:
        return None
    if profile == "anthropic":
        return ttl
    if profile == "openai":
        return ttl if ttl in ("30m", "12h") else (default if default in ("30m", "12h") else "")
    return None


# -- entry updates ---------------------------------------------------------------------------------
def upsert(entries: Entries, key: object, req: MeteredRequest, ttl_s: Decimal) -> None:
    """Write (or join a parallel write of) an entry: a live or pending entry keeps the earlier
    visibility and the later use; a dead one is replaced."""
    entry = entries.get(key)
    if entry is not None and entry.alive(req.start):
        entry.visible_at = min(entry.visible_at, req.visible_at)
        entry.last_use = max(entry.last_use, req.start)
        entry.ttl_s = max(entry.ttl_s, ttl_s)
    else:
        entries[key] = Entry(req.visible_at, req.start, ttl_s)


def refresh(entries: Entries, key: object, t: Decimal) -> bool:
    """Slide a live entry's lifetime from t (a read, free); False when it is not live."""
    entry = entries.get(key)
    if entry is None or not entry.live(t):
        return False
    entry.last_use = max(entry.last_use, t)
    return True


def _live(entries: Entries, key: object, t: Decimal) -> bool:
    entry = entries.get(key)
    return entry is not None and entry.live(t)


def breakpoints(req: MeteredRequest, spec: ProfileSpec) -> list[tuple[int, str]]:
    """(block index, tier) of every mark, top-level automatic one included, tiers validated."""
    assert spec.default_tier is not None
    marks = [(i, b.breakpoint) for i, b in enumerate(req.blocks) if b.breakpoint is not None]
    if req.auto_ttl is not None and req.blocks:
        last = len(req.blocks) - 1
        if not marks or marks[-1][0] != last:
            marks.append((last, req.auto_ttl))
    valid = spec.write_multipliers
    out: list[tuple[int, str]] = []
    for index, tier in marks:
        tier = tier or spec.default_tier
        if tier not in valid:
            raise BillingError(
                f"cache TTL {tier!r} is not offered by the {spec.name} profile; valid: "
                f"{', '.join(valid)}"
            )
        out.append((index, tier))
    return out


def _ranges(written: list[tuple[int, str]]) -> tuple[tuple[str, int], ...]:
    """Consecutive written breakpoints → one range per run of equal tiers."""
    out: list[tuple[str, int]] = []
    for index, tier in written:
        if out and out[-1][0] == tier:
            out[-1] = (tier, index)
        else:
            out.append((tier, index))
    return tuple(out)


# -- the profiles ----------------------------------------------------------------------------------
def check_anthropic_marks(marks: list[tuple[int, str]], options: ProfileOptions) -> None:
    """At most `max_breakpoints`, and every 1h breakpoint before every 5m one (else a 400)."""
    if len(marks) > options.max_breakpoints:
        raise BillingError(
            f"{len(marks)} cache breakpoints; at most {options.max_breakpoints} are allowed"
        )
    seen_5m = False
    for _, tier in marks:
        if tier == "5m":
            seen_5m = True
        elif seen_5m:
            raise BillingError("cache breakpoints with ttl '1h' must come before those with '5m'")


def plan_anthropic(
    req: MeteredRequest, entries: Entries, row: ModelPrice, options: ProfileOptions
) -> Plan:
    """Breakpoints write; lookups walk back from each breakpoint; mixed TTLs by A/B/C [A].

    A = the highest hit, B = the highest 1h breakpoint after A (else A), C = the last
    breakpoint: R = A, W1h = B − A, W5m = C − B. A breakpoint below the model's minimum is
    silently ignored; more than `max_breakpoints`, or a 1h breakpoint after a 5m one, is refused.
    """
    marks = breakpoints(req, SPECS["anthropic"])
    check_anthropic_marks(marks, options)
    minimum = row.min_tokens if row.min_tokens is not None else DEFAULT_OPENAI_MIN_TOKENS
    kept = [(i, tier) for i, tier in marks if req.blocks[i].end_tokens >= minimum]
    t = req.start
    hit = -1
    for index, _ in kept:
        for j in range(index, max(index - options.lookback_blocks, 0) - 1, -1):
            if _live(entries, req.blocks[j].key, t):
                hit = max(hit, j)
                break
    if hit >= 0:
        refresh(entries, req.blocks[hit].key, t)
    for index, _ in kept:
        if index < hit:
            refresh(entries, req.blocks[index].key, t)
    written = [(i, tier) for i, tier in kept if i > hit]
    for index, tier in written:
        upsert(entries, req.blocks[index].key, req, TIER_SECONDS[tier])
    return Plan(read_to=hit, writes=_ranges(written))


def plan_openai(
    req: MeteredRequest, entries: Entries, row: ModelPrice, options: ProfileOptions
) -> Plan:
    """GPT-5.6: an implicit breakpoint at the end of the latest user/tool message (unless
    `explicit_mode`), explicit marks, a 1,024-token minimum, at most 4 writes, no rounding.

    The lookup takes the longest live prefix among the block boundaries (implicit mode) or the
    first 2 and latest 50 explicit breakpoints (explicit mode).
    """
    spec = SPECS["openai"]
    marks = dict(breakpoints(req, spec))
    if not req.explicit_mode:
        implicit = next(
            (i for i in range(len(req.blocks) - 1, -1, -1) if req.blocks[i].eligible), None
        )
        if implicit is not None:
            marks.setdefault(implicit, "30m")
    minimum = row.min_tokens if row.min_tokens is not None else DEFAULT_OPENAI_MIN_TOKENS
    kept = sorted((i, tier) for i, tier in marks.items() if req.blocks[i].end_tokens >= minimum)
    if req.explicit_mode:
        explicit = sorted(marks)
        candidates = sorted(
            set(explicit[:OPENAI_LOOKUP_FIRST] + explicit[-OPENAI_LOOKUP_LATEST:]), reverse=True
        )
    else:
        candidates = list(range(len(req.blocks) - 1, -1, -1))
    t = req.start
    hit = next((j for j in candidates if _live(entries, req.blocks[j].key, t)), -1)
    if hit >= 0:
        refresh(entries, req.blocks[hit].key, t)
    written = [(i, tier) for i, tier in kept if i > hit][-options.openai_max_writes :]
    for index, tier in written:
        ttl = options.openai_ttl_s if tier == "30m" else TIER_SECONDS[tier]
        upsert(entries, req.blocks[index].key, req, ttl)
    return Plan(read_to=hit, writes=_ranges(written))


def plan_prefix(
    req: MeteredRequest,
    entries: Entries,
    ttl_s: Decimal,
    *,
    granularity: int,
    min_hit_tokens: int,
    boundaries_only: bool = False,
) -> Plan:
    """Automatic prefix caching (legacy OpenAI, Gemini implicit, DeepSeek): every request
    caches its whole prompt at no premium; the hit is the longest live prefix, rounded down to
    the granularity and void under the minimum (applied by `bill` on exact tokens).

    `boundaries_only` (DeepSeek `request_boundaries`): only a request's end is persisted.
    """
    t = req.start
    hit = next(
        (j for j in range(len(req.blocks) - 1, -1, -1) if _live(entries, req.blocks[j].key, t)),
        -1,
    )
    if boundaries_only:
        if hit >= 0:
            refresh(entries, req.blocks[hit].key, t)
        if req.blocks:
            upsert(entries, req.blocks[-1].key, req, ttl_s)
    else:
        for block in req.blocks:  # the whole prompt is cached again: refresh or write each prefix
            upsert(entries, block.key, req, ttl_s)
    return Plan(read_to=hit, granularity=granularity, min_hit_tokens=min_hit_tokens)


def plan_explicit(req: MeteredRequest, objects: dict[str, CachedContent]) -> Plan:
    """Gemini explicit caching: a request that names a live cached-content object of its own
    isolation scope and model reads all of it; nothing else is cached."""
    if req.cached_content is None:
        return Plan()
    obj = objects.get(req.cached_content)
    if obj is None or obj.tenant != req.tenant or obj.scope_key != req.scope_key:
        raise BillingError(f"no cached content {req.cached_content!r} for this tenant")
    if not obj.live(req.start):
        raise BillingError(f"cached content {req.cached_content!r} has expired or was deleted")
    if obj.model != req.model:
        raise BillingError(
            f"cached content {req.cached_content!r} was created for model {obj.model!r}"
        )
    return Plan(read_tokens=obj.num_tokens)
