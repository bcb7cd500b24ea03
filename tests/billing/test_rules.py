"""The profiles' rules beyond the published vectors: limits, orderings, isolation, peaks, rent."""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal
from typing import Any

import pytest

from gateway.billing.events import EventError
from gateway.billing.pricing.ledger import CacheLedger
from gateway.billing.pricing.model import BillingError, CachedContent
from gateway.billing.pricing.money import display, parse_instant
from gateway.billing.pricing.prices import PriceTable, load_price_table
from gateway.billing.pricing.rules import ProfileOptions, peak_multiplier
from gateway.billing.simulate import Simulation, simulate


def line(t: float, segments: list[tuple[str, int, str | None]], **extra: Any) -> str:
    segs = []
    for segment_id, tokens, ttl in segments:
        seg: dict[str, Any] = {"id": segment_id, "tokens": tokens}
        if ttl is not None:
            seg["cache_control"] = {"ttl": ttl} if ttl else {}
        segs.append(seg)
    return json.dumps({"t": t, "tenant": extra.pop("tenant", "acme"), "segments": segs, **extra})


def sim(
    lines: list[str], profile: str = "anthropic", model: str = "sonnet-5", **kw: Any
) -> Simulation:
    return simulate(lines, profile, model, **kw)


def test_more_than_four_breakpoints_or_1h_after_5m_are_refused() -> None:
    five = [(f"s{i}", 2000, "5m") for i in range(5)]
    result = sim([line(0, five)])
    assert result.rows[0].error == "5 cache breakpoints; at most 4 are allowed"
    assert result.totals.refused == 1 and result.totals.cost == 0
    disordered = [("a", 2000, "5m"), ("b", 2000, "1h")]
    assert "must come before" in (sim([line(0, disordered)]).rows[0].error or "")
    assert "valid: 5m, 1h" in (sim([line(0, [("a", 2000, "2h")])]).rows[0].error or "")


def test_mixed_ttls_bill_a_b_c() -> None:
    # r1 writes 1h up to 4,000 and 5m up to 10,000; r2 (t=600) finds only the 1h entry alive:
    # A = 4,000, B = A (no 1h breakpoint after A), C = 10,000 → R 4,000, W1h 0, W5m 6,000
    blocks = [("system", 4000, "1h"), ("history", 6000, "5m")]
    result = sim([line(0, blocks), line(600, blocks)])
    first, second = (row.usage for row in result.rows)
    assert first["cache_creation"] == {
        "ephemeral_5m_input_tokens": 6000,
        "ephemeral_1h_input_tokens": 4000,
    }
    assert second["cache_read_input_tokens"] == 4000
    assert second["cache_creation"] == {
        "ephemeral_5m_input_tokens": 6000,
        "ephemeral_1h_input_tokens": 0,
    }
    # IET: 4,000·2 + 6,000·1.25 = 15,500, then 400 + 7,500
    assert [r.charge.input_equivalent_tokens for r in result.rows if r.charge] == [15_500, 7_900]


def test_the_lookback_walks_back_at_most_20_blocks_and_is_a_parameter() -> None:
    base = [("system", 5000, "5m")]
    extra = [(f"block{i}", 10, None) for i in range(21)]
    later = base[:1] + extra
    later = [(i, n, None) for i, n, _ in later[:-1]] + [(later[-1][0], later[-1][1], "5m")]
    lines = [line(0, base), line(10, later)]
    missed = sim(lines)  # the entry is 21 blocks behind the breakpoint
    assert missed.rows[1].usage["cache_read_input_tokens"] == 0
    hit = sim(lines, options=ProfileOptions(lookback_blocks=21))
    assert hit.rows[1].usage["cache_read_input_tokens"] == 5000


def test_automatic_breakpoint_goes_on_the_last_block() -> None:
    lines = [
        json.dumps(
            {"t": 0, "tenant": "a", "segments": [{"id": "x", "tokens": 3000}], "cache_control": {}}
        ),
        json.dumps(
            {
                "t": 5,
                "tenant": "a",
                "segments": [{"id": "x", "tokens": 3000}, {"id": "y", "tokens": 100}],
                "cache_control": {"ttl": "1h"},
            }
        ),
    ]
    first, second = (row.usage for row in sim(lines).rows)
    assert first["cache_creation"]["ephemeral_5m_input_tokens"] == 3000
    assert second["cache_read_input_tokens"] == 3000
    assert second["cache_creation"]["ephemeral_1h_input_tokens"] == 100


def test_tenants_never_read_each_others_entries() -> None:
    blocks = [("shared-text", 10_000, "5m")]
    result = sim([line(0, blocks, tenant="acme"), line(10, blocks, tenant="globex")])
    assert [row.usage["cache_read_input_tokens"] for row in result.rows] == [0, 0]


def test_a_ping_reads_and_refreshes_without_output() -> None:
    blocks = [("context", 10_000, "5m")]
    result = sim([line(0, blocks), line(270, blocks, max_tokens=0), line(540, blocks)])
    assert [row.usage["cache_read_input_tokens"] for row in result.rows] == [0, 10_000, 10_000]
    with pytest.raises(EventError, match="exceeds max_tokens"):
        sim([line(0, blocks, max_tokens=0, output_tokens=5)])


def test_openai_makes_at_most_four_writes_and_offers_12h() -> None:
    marks = [(f"s{i}", 2000, "") for i in range(6)]
    request = json.dumps(
        {
            "t": 0,
            "tenant": "a",
            "mode": "explicit",
            "segments": [{"id": i, "tokens": n, "cache_control": {}} for i, n, _ in marks],
        }
    )
    result = sim([request], "openai", "gpt-5.6")
    # W still runs to the last breakpoint; only the deepest four get entries
    assert result.rows[0].usage["prompt_tokens_details"]["cache_write_tokens"] == 12_000
    retention = json.dumps(
        {
            "t": 0,
            "tenant": "a",
            "segments": [{"id": "x", "tokens": 4000, "cache_control": {"ttl": "12h"}}],
        }
    )
    again = retention.replace('"t": 0', '"t": 40000')
    rows = sim([retention, again], "openai", "gpt-5.6").rows
    assert rows[0].charge is not None and rows[0].charge.input_equivalent_tokens == 10_000  # 2.5×
    assert rows[1].usage["prompt_tokens_details"]["cached_tokens"] == 4000  # 40,000 s < 12 h


def test_deepseek_peak_hours_weekends_and_holidays() -> None:
    monday = parse_instant("2026-09-07T00:00:00Z")
    assert peak_multiplier(monday + 3600, frozenset()) == 2  # 01:00
    assert peak_multiplier(monday + 4 * 3600 - 1, frozenset()) == 2
    assert peak_multiplier(monday + 4 * 3600, frozenset()) == 1  # half-open
    assert peak_multiplier(monday + 6 * 3600, frozenset()) == 2
    assert peak_multiplier(monday + 10 * 3600, frozenset()) == 1
    assert peak_multiplier(monday - 86400 + 3600, frozenset()) == 1  # Sunday
    assert peak_multiplier(monday + 3600, frozenset({dt.date(2026, 9, 7)})) == 1
    lines = [line(0, [("p", 1000, None)], output_tokens=100)]
    peak = sim(lines, "deepseek", "deepseek-v4.1-flash", start=monday + 7200)
    off = sim(lines, "deepseek", "deepseek-v4.1-flash", start=monday + 12 * 3600)
    assert off.totals.cost == Decimal("0.00021")  # 1,000 × 0.15 + 100 × 0.60, per M
    assert peak.totals.cost == 2 * off.totals.cost


def test_deepseek_64_token_units_and_request_boundaries() -> None:
    lines = [
        line(0, [("a", 100, None), ("b", 50, None)]),
        line(60, [("a", 100, None), ("b", 50, None), ("c", 10, None)]),
    ]
    units = sim(lines, "deepseek", "deepseek-v4-pro")
    assert units.rows[1].usage["prompt_cache_hit_tokens"] == 128  # 150 → two whole units
    assert units.rows[1].usage["prompt_cache_miss_tokens"] == 32
    assert units.rows[1].charge is not None
    assert (
        units.rows[1].charge.input_cost
        == Decimal(128) * Decimal("0.022") / 10**6 + Decimal(32) * Decimal("0.66") / 10**6
    )
    boundary = sim(
        lines,
        "deepseek",
        "deepseek-v4-pro",
        options=ProfileOptions(deepseek_unit="request_boundaries"),
    )
    assert boundary.rows[1].usage["prompt_cache_hit_tokens"] == 150
    # a prefix that ends inside an earlier request's prompt is no boundary
    inner = [
        line(0, [("a", 100, None), ("b", 50, None)]),
        line(60, [("a", 100, None), ("z", 50, None)]),
    ]
    assert (
        sim(
            inner,
            "deepseek",
            "deepseek-v4-pro",
            options=ProfileOptions(deepseek_unit="request_boundaries"),
        )
        .rows[1]
        .usage["prompt_cache_hit_tokens"]
        == 0
    )
    assert sim(inner, "deepseek", "deepseek-v4-pro").rows[1].usage["prompt_cache_hit_tokens"] == 64


def test_rent_is_integrated_piecewise_across_the_2027_price_change() -> None:
    row = PriceTable.default().lookup("google_explicit", "gemini-3.1-pro")
    start = parse_instant("2026-12-31T23:00:00Z")
    # 100,000 tokens: one hour at $4.50/M/h, one at $9.00
    assert row.rent_between(100_000, start, start + 7200) == Decimal("1.35")
    assert row.rent_between(100_000, start + 7200, start) == Decimal("-1.35")
    ledger = CacheLedger("google_explicit", PriceTable.default())
    obj = CachedContent("doc", "acme", "gemini-3.1-pro", 100_000, 1, start, start + 3600)
    assert ledger.create_content(obj).rent == Decimal("0.45")
    extended = ledger.update_content("acme", "doc", start + 60, start + 7200)
    assert extended.rent == Decimal("0.90")


def test_explicit_contents_belong_to_one_tenant_and_end_at_expiry_or_deletion() -> None:
    ledger = CacheLedger("google_explicit", PriceTable.default())
    obj = CachedContent("doc", "acme", "gemini-3.1-pro", 10_000, 1, Decimal(0), Decimal(3600))
    ledger.create_content(obj)
    with pytest.raises(BillingError, match="no cached content 'doc' for this tenant"):
        ledger.content("globex", "doc", Decimal(10))
    with pytest.raises(BillingError, match="expired"):
        ledger.content("acme", "doc", Decimal(3600))
    with pytest.raises(BillingError, match="already exists"):
        ledger.create_content(obj)
    refund = ledger.delete_content("acme", "doc", Decimal(1800))
    assert refund.rent == -row_rent(10_000, 1800)
    with pytest.raises(BillingError, match="expired or was deleted"):
        ledger.content("acme", "doc", Decimal(1801))
    with pytest.raises(BillingError, match="google_explicit profile"):
        CacheLedger("anthropic", PriceTable.default()).create_content(obj)


def row_rent(tokens: int, seconds: int) -> Decimal:
    return (
        PriceTable.default()
        .lookup("google_explicit", "gemini-3.1-pro")
        .rent_between(tokens, Decimal(0), Decimal(seconds))
    )


def test_simulate_translates_marks_and_skips_explicit_ops_under_other_profiles() -> None:
    lines = (
        (__import__("pathlib").Path(__file__).parent / "v12_google_explicit.jsonl")
        .read_text()
        .splitlines()
    )
    result = sim(lines, "anthropic", "sonnet-5")
    assert [row.skipped is not None for row in result.rows] == [True, False, False, False, True]
    # the object's 100,000 tokens lead each request, uncached without breakpoints
    assert result.totals.prompt_tokens == 3 * 102_000
    assert result.totals.uncached_tokens == 3 * 102_000


def test_a_prices_file_overrides_and_extends_the_table(tmp_path: Any) -> None:
    prices = tmp_path / "prices.yaml"
    prices.write_text(
        "anthropic:\n  sonnet-5: {input: 3}\n"
        "  house-model: {input: '1.5', output: 6, min_tokens: 100}\n"
    )
    table = load_price_table(prices)
    assert table.lookup("anthropic", "sonnet-5").input == 3
    assert table.lookup("anthropic", "sonnet-5").output == 10  # kept
    assert table.lookup("anthropic", "house-model").min_tokens == 100
    prices.write_text("anthropic:\n  house: {input: 1}\n")
    with pytest.raises(ValueError, match="needs 'input' and 'output'"):
        load_price_table(prices)
    prices.write_text("antropic: {}\n")
    with pytest.raises(ValueError, match="unknown billing profile 'antropic'"):
        load_price_table(prices)


def test_malformed_lines_name_the_line_and_field() -> None:
    with pytest.raises(EventError, match="line 1: malformed JSON"):
        sim(["{"])
    with pytest.raises(EventError, match=r"line 2: segments\[0\].tokens must be an integer"):
        sim(["", '{"t": 0, "segments": [{"id": "a", "tokens": -1}]}'])
    with pytest.raises(EventError, match="unknown field"):
        sim(['{"t": 0, "segments": [], "colour": 1}'])
    with pytest.raises(EventError, match=r"op 'cache\.burn'"):
        sim(['{"t": 0, "op": "cache.burn", "id": "x"}'])


def test_display_rounds_half_up_only_at_the_end() -> None:
    assert display(Decimal("5.075")) == "5.08"
    assert display(Decimal("0.005")) == "0.01"  # half-up, not banker's rounding (0.00)
    assert display(Decimal("0.015")) == "0.02"
    assert display(Decimal("0.88415")) == "0.88"
