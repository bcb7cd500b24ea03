"""The pricing engine's vocabulary: what a request looks like to the meter, and what it owes.

A prompt is a sequence of blocks (content blocks: tools, a system prompt, a message or one of
its parts). `Block.key` names the prefix through that block (a chained hash of the blocks'
identities), so two requests share an entry exactly when their prefixes are identical.
`end_tokens` are cumulative. Breakpoints sit on blocks. All times are unix seconds as Decimal.

Nothing here does I/O: the same objects flow through `kvgate billing simulate` and the live
meter.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from decimal import Decimal

from gateway.billing.pricing.money import MILLION, ZERO

# -- TTL tiers -----------------------------------------------------------------------------------
TIER_SECONDS: dict[str, Decimal] = {
    "5m": Decimal(300),
    "1h": Decimal(3600),
    "30m": Decimal(1800),
    "12h": Decimal(43200),
}
"""Named lifetimes: Anthropic's 5m/1h, OpenAI 5.6's ≥30 min (simulated as exactly 30) and 12h."""


@dataclass(frozen=True, slots=True)
class Block:
    """One content block. Invariant: `end_tokens` never decreases along a prompt."""

    key: Hashable
    """The prefix through this block: equal keys ⇔ identical prefixes (within one scope)."""
    end_tokens: int
    """Cumulative prompt tokens at the end of this block."""
    breakpoint: str | None = None
    """A cache mark on this block: "" (the profile's default TTL) or a tier name; None: none."""
    eligible: bool = True
    """Ends a user or tool message: where OpenAI 5.6 puts its implicit breakpoint."""


@dataclass(frozen=True, slots=True)
class MeteredRequest:
    """One request as the rules see it."""

    request_id: str
    tenant: str
    model: str
    start: Decimal
    """The request's start: every TTL clock counts from starts [P]."""
    visible_at: Decimal
    """The writer's first token: its entries are visible from here on."""
    blocks: tuple[Block, ...]
    num_prompt_tokens: int
    """N, the whole prompt; tokens after the last block are uncached."""
    num_output_tokens: int = 0
    max_tokens: int | None = None
    explicit_mode: bool = False
    """OpenAI `mode: "explicit"`: no implicit breakpoint."""
    auto_ttl: str | None = None
    """Anthropic top-level `cache_control`: a breakpoint on the last block ("" = default TTL)."""
    cached_content: str | None = None
    """A google_explicit cached-content object whose blocks lead this prompt."""
    scope: str = ""
    """The isolation scope whose entries the request reads and writes (an end user of a
    `user`-scoped tenant); "" is the tenant's own. Never the tenant's name alone when the
    tenant isolates its end users: one user's prefix must not be another's read."""

    @property
    def scope_key(self) -> str:
        """What the ledger keys this request's entries by."""
        return self.scope or self.tenant


@dataclass(frozen=True, slots=True)
class Plan:
    """What a request reads and writes, in block indices (token counts are applied by `bill`).

    Invariant: `read_to` < every write's end, and writes ascend: the prompt splits into
    [0, read_to] read, then one range per write, then the uncached tail.
    """

    read_to: int = -1
    """Index of the block the hit reaches (-1: no hit)."""
    writes: tuple[tuple[str, int], ...] = ()
    """(tier, last block index) for each consecutive written range after the hit."""
    read_tokens: int | None = None
    """A fixed hit size (an explicit cached-content object), overriding `read_to`."""
    granularity: int = 1
    """The hit is rounded down to a multiple of this (128 legacy OpenAI, 64 DeepSeek)."""
    min_hit_tokens: int = 0
    """A hit shorter than this reads nothing (legacy OpenAI 1,024; Google's minimums)."""


@dataclass(frozen=True, slots=True)
class Charge:
    """What one request owes. Invariant: uncached + read + Σ written = prompt tokens."""

    num_prompt_tokens: int
    uncached: int
    read: int
    written: dict[str, int]
    """Tokens written per TTL tier (only tiers with a write premium or a report)."""
    num_output_tokens: int
    write_multipliers: dict[str, Decimal]
    read_price: Decimal
    input_price: Decimal
    output_price: Decimal
    peak_multiplier: Decimal
    input_cost: Decimal
    output_cost: Decimal
    rent: Decimal = ZERO

    @property
    def num_written(self) -> int:
        return sum(self.written.values())

    @property
    def cost(self) -> Decimal:
        return self.input_cost + self.output_cost + self.rent

    @property
    def cost_without_caching(self) -> Decimal:
        """What the same request would cost with no caching at all: every prompt token at the
        input price, the same output, no rent (`p_in·N + p_out·O`, times m(t))."""
        return self.input_price * self.num_prompt_tokens * self.peak_multiplier / MILLION + (
            self.output_cost
        )

    @property
    def input_equivalent_tokens(self) -> Decimal:
        """IET = U + Σ w·W + r·R (docs/billing.md#common-model), r = read price / input price."""
        from gateway.billing.pricing.money import divide

        premium = sum(
            (self.write_multipliers[tier] * tokens for tier, tokens in self.written.items()),
            ZERO,
        )
        read = divide(self.read_price * self.read, self.input_price) if self.input_price else ZERO
        return Decimal(self.uncached) + premium + read


@dataclass(slots=True)
class Entry:
    """One tenant-visible cache entry. Live at t ⇔ visible_at ≤ t < last_use + ttl_s."""

    visible_at: Decimal
    last_use: Decimal
    ttl_s: Decimal

    def live(self, t: Decimal) -> bool:
        return self.visible_at <= t < self.last_use + self.ttl_s

    def alive(self, t: Decimal) -> bool:
        """Not expired at t, whether or not visible yet (a parallel writer's pending entry)."""
        return t < self.last_use + self.ttl_s


@dataclass(slots=True)
class CachedContent:
    """A google_explicit cached-content object: rent accrues from creation to min(expiry,
    deletion); reads do not extend it, only updates do."""

    object_id: str
    tenant: str
    model: str
    num_tokens: int
    num_blocks: int
    created: Decimal
    expires: Decimal
    deleted: Decimal | None = None
    payload: dict[str, object] = field(default_factory=dict)
    """What the front end needs to use it (the live gateway keeps its messages here)."""
    scope: str = ""
    """The isolation scope that made it and alone may read it in a prompt ("" is the tenant's
    own); its tenant manages it (reads, extends, deletes it) whatever the scope."""

    @property
    def scope_key(self) -> str:
        return self.scope or self.tenant

    def live(self, t: Decimal) -> bool:
        return self.created <= t < self.expires and (self.deleted is None or t < self.deleted)


class BillingError(ValueError):
    """A request the profile's rules refuse (a 400 in the gateway, an error line in simulate)."""
