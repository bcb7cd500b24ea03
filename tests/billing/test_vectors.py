"""Every vector of docs/billing.md#test-vectors, exact, through `simulate` on the workloads here."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from gateway.billing.simulate import Simulation, simulate

HERE = Path(__file__).parent


def run(name: str, profile: str, model: str, **kwargs: Any) -> Simulation:
    return simulate((HERE / f"{name}.jsonl").read_text().splitlines(), profile, model, **kwargs)


def iets(sim: Simulation) -> list[Decimal]:
    return [row.charge.input_equivalent_tokens for row in sim.rows if row.charge is not None]


def costs(sim: Simulation) -> list[Decimal]:
    return [row.charge.cost for row in sim.rows if row.charge is not None]


def test_1_anthropic_5m_write_then_read() -> None:
    sim = run("v01_anthropic_5m", "anthropic", "sonnet-5")
    first, second = (row.usage for row in sim.rows)
    assert first["cache_read_input_tokens"] == 0
    assert first["cache_creation_input_tokens"] == 10_000
    assert first["cache_creation"]["ephemeral_5m_input_tokens"] == 10_000
    assert first["input_tokens"] == 0
    assert second["cache_read_input_tokens"] == 10_000
    assert second["cache_creation_input_tokens"] == 500
    assert iets(sim) == [12_500, 1_625]
    assert costs(sim) == [Decimal("0.026"), Decimal("0.00425")]


def test_2_sliding_ttl_with_a_strict_boundary() -> None:
    sim = run("v02_sliding_ttl", "anthropic", "sonnet-5")
    reads = [row.usage["cache_read_input_tokens"] for row in sim.rows]
    assert reads == [0, 10_000, 10_000, 0]  # 898 = 598 + 300 is a miss
    assert sim.totals.iet == 27_000
    assert sim.totals.cost == Decimal("0.054")


def test_3_the_clock_counts_from_the_request_start() -> None:
    sim = run("v03_clock_at_start", "anthropic", "sonnet-5")
    second = sim.rows[1].usage
    assert second["cache_read_input_tokens"] == 0
    assert iets(sim)[1] == 12_500


def test_4_one_hour_ttl() -> None:
    sim = run("v04_1h", "anthropic", "sonnet-5")
    assert iets(sim) == [20_000, 1_000, 1_000, 20_000]  # expiry 8,999: the read at 9,000 misses
    for row in (sim.rows[0], sim.rows[3]):
        assert row.usage["cache_creation"]["ephemeral_1h_input_tokens"] == 10_000
        assert row.usage["cache_creation"]["ephemeral_5m_input_tokens"] == 0


def test_5_read_classes() -> None:
    opus = run("v01_anthropic_5m", "anthropic", "opus-5.5")
    assert iets(opus)[1] == 1_125
    assert opus.rows[1].charge is not None
    assert opus.rows[1].charge.input_cost == Decimal("0.0045")  # at $4/M
    fable = run("v01_anthropic_5m", "anthropic", "fable-5.1")
    assert iets(fable)[1] == 875


def test_6_minimums_per_model() -> None:
    sonnet = run("v06_minimum", "anthropic", "sonnet-5")  # minimum 1,024
    for row in sonnet.rows:
        assert row.usage["input_tokens"] == 1_000
        assert row.usage["cache_creation_input_tokens"] == row.usage["cache_read_input_tokens"] == 0
    assert iets(run("v06_minimum", "anthropic", "fable-5")) == [1_250, 100]  # minimum 512
    haiku = run("v06_minimum_haiku", "anthropic", "haiku-4.5")  # minimum 4,096
    assert [row.usage["input_tokens"] for row in haiku.rows] == [4_000, 4_000]


def test_7_fan_out_pays_a_write_per_sibling_unless_they_wait_for_the_first_token() -> None:
    sim = run("v07_fan_out", "anthropic", "sonnet-5")
    assert [row.usage["cache_creation_input_tokens"] for row in sim.rows] == [10_000] * 3 + [0]
    assert sim.totals.iet == 38_500
    assert run("v07_fan_out_waiting", "anthropic", "sonnet-5").totals.iet == 15_500


def test_14_with_kv_events_the_leaders_entry_is_visible_from_its_block_stored() -> None:
    """Siblings released at the leader's BlockStored read its entry; with the entry visible
    only from the first token, the siblings released then would each pay a write, vector 7's
    38,500 again (why the gateway with billing used to hold them until the first token)."""
    sim = run("v14_fan_out_events", "anthropic", "sonnet-5")
    assert [row.usage["cache_read_input_tokens"] for row in sim.rows] == [0] + [10_000] * 3
    assert sim.totals.iet == 15_500
    assert run("v14_fan_out_events_first_token", "anthropic", "sonnet-5").totals.iet == 38_500
    # the first token still bounds visibility when it comes first (stored_s after it)
    line = (
        '{"t": 0, "tenant": "acme", "segments": [{"id": "c", "tokens": 10000, '
        '"cache_control": {}}], "first_token_s": 1.5, "stored_s": 2.0}'
    )
    r2 = line.replace('"t": 0', '"t": 1.6').replace(', "stored_s": 2.0', "")
    late = simulate([line, r2], "anthropic", "sonnet-5")
    assert [row.usage["cache_read_input_tokens"] for row in late.rows] == [0, 10_000]


def test_8_openai_implicit_breakpoint_and_30_minute_lifetime() -> None:
    sim = run("v08_openai", "openai", "gpt-5.6")
    details = [row.usage["prompt_tokens_details"] for row in sim.rows]
    assert [d["cached_tokens"] for d in details] == [0, 10_000, 12_000, 0]
    assert [d["cache_write_tokens"] for d in details] == [10_000, 2_000, 0, 12_000]
    assert [row.usage["prompt_tokens"] for row in sim.rows] == [10_000, 12_000, 12_000, 12_000]
    assert iets(sim) == [12_500, 3_500, 1_200, 15_000]


def test_9_openai_explicit_breakpoint_and_the_minimum() -> None:
    sim = run("v09_openai_explicit", "openai", "gpt-5.6")
    explicit, small = sim.rows
    assert explicit.usage["prompt_tokens_details"] == {
        "cached_tokens": 0,
        "cache_write_tokens": 8_000,
    }
    assert iets(sim) == [12_000, 1_000]
    assert small.usage["prompt_tokens_details"]["cache_write_tokens"] == 0


def test_10_openai_legacy_128_token_steps_and_idle_expiry() -> None:
    gpt4o = run("v10_openai_legacy", "openai_legacy", "gpt-4o")  # r = 0.5
    cached = [row.usage["prompt_tokens_details"]["cached_tokens"] for row in gpt4o.rows]
    assert cached == [0, 1_408, 0]
    assert iets(gpt4o) == [1_500, 1_096, 1_800]
    assert iets(run("v10_openai_legacy", "openai_legacy", "gpt-5"))[1] == Decimal("532.8")


def test_11_google_implicit() -> None:
    sim = run("v11_google_implicit", "google_implicit", "gemini-3.1-pro")
    by_tenant = {(row.event.tenant, row.event.t): row for row in sim.rows if row.charge is not None}
    first, second = by_tenant["acme", 0], by_tenant["acme", 60]
    assert first.charge is not None and first.charge.cost == Decimal("0.024")
    meta = second.usage["usageMetadata"]
    assert meta["cachedContentTokenCount"] == 12_000 and meta["promptTokenCount"] == 13_500
    assert second.charge is not None
    assert second.charge.input_equivalent_tokens == 2_700
    assert second.charge.cost == Decimal("0.0054")
    for t in (0, 60):  # 3,000 < 4,096: never cached
        assert by_tenant["globex", t].usage["usageMetadata"]["cachedContentTokenCount"] == 0


def test_12_google_explicit_creation_reads_and_rent_until_deletion() -> None:
    sim = run("v12_google_explicit", "google_explicit", "gemini-3.1-pro")
    create, *requests, delete = sim.rows
    assert create.charge is not None and delete.charge is not None
    assert create.charge.input_cost == Decimal("0.20")
    assert create.charge.rent == Decimal("0.90")  # through the 2 h expiry
    for row in requests:
        assert row.charge is not None
        assert row.charge.input_equivalent_tokens == 12_000
        assert row.charge.cost == Decimal("0.024")
    assert create.charge.rent + delete.charge.rent == Decimal("0.675")  # 0.1 × 4.50 × 1.5
    assert sim.totals.cost == Decimal("0.947")


@pytest.mark.parametrize(
    ("scenario", "exact", "shown"),
    [
        ("uncached", "5.075", "5.08"),
        ("warm_5m", "0.88415", "0.88"),
        ("expiries", "1.87775", "1.88"),
        ("1h", "1.0124", "1.01"),
        ("pings", "0.97055", "0.97"),
    ],
)
def test_the_50_step_session_through_the_engine(scenario: str, exact: str, shown: str) -> None:
    totals = run(f"session_{scenario}", "anthropic", "sonnet-5").totals.as_json()
    assert totals["cost"] == exact
    assert totals["cost_display"] == shown
    assert totals["output_tokens"] == 20_000


def test_the_session_sums_of_rules_2_1() -> None:
    warm = run("session_warm_5m", "anthropic", "sonnet-5").totals
    assert (warm.read_tokens, warm.written_tokens, warm.iet) == (2_352_000, 85_500, 342_075)
    gaps = run("session_expiries", "anthropic", "sonnet-5").totals
    assert (gaps.read_tokens, gaps.written_tokens, gaps.iet) == (1_920_000, 517_500, 838_875)
    pings = run("session_pings", "anthropic", "sonnet-5").totals
    assert pings.read_tokens - warm.read_tokens == 432_000  # the lost reads, read by pings


def test_the_session_files_are_the_generators_output() -> None:
    from tests.billing.generate import SCENARIOS, render

    for name in SCENARIOS:
        assert (HERE / f"session_{name}.jsonl").read_text() == render(name), name


def test_gap_placement_matters_as_rules_2_1_says() -> None:
    from tests.billing.generate import session

    def priced(gap_steps: range) -> str:
        lines = session("5m", gaps=True, pings=False, gap_steps=frozenset(gap_steps))
        text = [json.dumps(line) for line in lines]
        return simulate(text, "anthropic", "sonnet-5").totals.as_json()["cost_display"]

    assert priced(range(5, 46, 5)) == "1.85"
    assert priced(range(6, 47, 5)) == "1.88"
    assert priced(range(7, 48, 5)) == "1.91"
