"""docs/billing.md#formulas: break-evens, effective multipliers, pings, compaction payback.

Pure functions over Decimals (exact where the inputs are; divisions in a 50-digit context).
"""

from __future__ import annotations

from decimal import Decimal

from gateway.billing.pricing.money import divide

PING_INTERVAL_MIN = Decimal("4.5")
"""Pings every 4.5 minutes keep a 5-minute entry alive with half a minute to spare."""


def break_even_reads(w: Decimal, r: Decimal) -> Decimal:
    """Reads after which a write pays off: n > (w − 1)/(1 − r)."""
    return divide(w - 1, 1 - r)


def break_even_hit_rate(w: Decimal, r: Decimal) -> Decimal:
    """The hit rate above which caching is cheaper: h* = (w − 1)/(w − r)."""
    return divide(w - 1, w - r)


def effective_multiplier(
    uncached: Decimal, written: Decimal, read: Decimal, w: Decimal, r: Decimal
) -> Decimal:
    """f_u + w·f_w + r·f_r, each f a share of all input (the counts need not be normalized)."""
    total = uncached + written + read
    return divide(uncached + w * written + r * read, total)


def pings_for_gap(gap_min: Decimal) -> int:
    """Pings needed to bridge a gap of g minutes at one per 4.5 minutes: ceil(g/4.5) − 1."""
    quotient = divide(gap_min, PING_INTERVAL_MIN)
    ceiling = int(quotient.to_integral_value(rounding="ROUND_CEILING"))
    return max(ceiling - 1, 0)


def pings_win_until(cost_to_beat: Decimal, ping_cost: Decimal, base: Decimal = Decimal(0)) -> int:
    """The largest n with base + ping_cost·n ≤ cost_to_beat (pings are cheaper or equal)."""
    return int(divide(cost_to_beat - base, ping_cost).to_integral_value(rounding="ROUND_FLOOR"))


def longest_gap_for_pings(max_pings: int) -> Decimal:
    """The longest gap (minutes) that `max_pings` pings bridge: 4.5·(n + 1)."""
    return PING_INTERVAL_MIN * (max_pings + 1)


def compaction_payback_steps(
    w: Decimal, r: Decimal, compacted: Decimal, context: Decimal
) -> Decimal:
    """Steps for compaction to pay back: ((w − r + 5)c + rC)/(r(C − c))."""
    return divide((w - r + 5) * compacted + r * context, r * (context - compacted))
