"""Vector 13 and the formulas of docs/billing.md#formulas, exact."""

from __future__ import annotations

from decimal import Decimal

from gateway.billing.pricing.formulas import (
    break_even_hit_rate,
    break_even_reads,
    compaction_payback_steps,
    effective_multiplier,
    longest_gap_for_pings,
    pings_for_gap,
    pings_win_until,
)
from gateway.billing.pricing.money import display, divide

W5M, W1H, R = Decimal("1.25"), Decimal("2"), Decimal("0.1")


def test_break_even_reads_and_hit_rates() -> None:
    assert display(break_even_reads(W5M, R)) == "0.28"
    assert display(break_even_reads(W1H, R)) == "1.11"
    assert display(break_even_hit_rate(W5M, R), Decimal("0.0001")) == "0.2174"
    assert display(break_even_hit_rate(W1H, R), Decimal("0.0001")) == "0.5263"
    assert display(break_even_hit_rate(W5M, Decimal("0.05")), Decimal("0.0001")) == "0.2083"
    assert break_even_hit_rate(Decimal(1), Decimal("0.02")) == 0  # DeepSeek: no write premium


def test_one_read_wins_at_5m_but_not_at_1h() -> None:
    # 5m: write + one read = 1.35 against two uncached sends = 2.00; 1h: 2.10 against 2.00
    assert W5M + R < 2 < W1H + R


def test_the_warm_sessions_effective_multiplier() -> None:
    multiplier = effective_multiplier(Decimal(0), Decimal(85_500), Decimal(2_352_000), W5M, R)
    assert display(multiplier, Decimal("0.0001")) == "0.1403"
    assert multiplier == divide(Decimal(342_075), Decimal(2_437_500))  # IET / N


def test_pings_against_the_1h_premium_and_against_a_rewrite() -> None:
    # each ping costs 0.1 × context; the 1h premium costs 0.75 more than a 5m write
    assert pings_win_until(Decimal("0.75"), R) == 7
    assert longest_gap_for_pings(7) == 36
    # a rewrite costs 1.25 against 0.1 (the step's own read) + 0.1 per ping
    assert pings_win_until(W5M, R, base=R) == 11
    assert longest_gap_for_pings(11) == 54
    assert pings_for_gap(Decimal(8)) == 1 and pings_for_gap(Decimal(36)) == 7
    assert pings_for_gap(Decimal("36.1")) == 8


def test_compaction_payback() -> None:
    context = Decimal(80_000)
    assert (
        display(compaction_payback_steps(W5M, R, Decimal(5_000), context), Decimal("0.1")) == "5.2"
    )
    assert (
        display(compaction_payback_steps(W5M, R, Decimal(20_000), context), Decimal("0.1"))
        == "21.8"
    )
