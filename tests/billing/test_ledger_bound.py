"""The billing ledger's memory is bounded by configuration (issue 14, item 24): past
`max_entries`, dead entries go first, then those that expire soonest, down to 90% of the bound;
the tenant whose live entry went pays a write where the contract would give a read."""

from __future__ import annotations

from decimal import Decimal

from gateway.billing.pricing.ledger import CacheLedger
from gateway.billing.pricing.model import Block, MeteredRequest
from gateway.billing.pricing.prices import PriceTable

MODEL = "gpt-5.6"


def request(i: int, prefix: int, start: Decimal) -> MeteredRequest:
    """A 4,000-token prompt whose two blocks are the prefix's own (one openai entry each)."""
    return MeteredRequest(
        request_id=f"r{i}",
        tenant="acme",
        model=MODEL,
        start=start,
        visible_at=start + Decimal("0.5"),
        blocks=(
            Block(f"p{prefix}/a".encode(), 2_000, None, True),
            Block(f"p{prefix}/b".encode(), 4_000, None, True),
        ),
        num_prompt_tokens=4_100,
    )


def test_entries_past_the_bound_go_soonest_expiring_first() -> None:
    ledger = CacheLedger("openai", PriceTable.default(), max_entries=1_000)
    for i in range(5_000):  # 5,000 distinct prefixes within one 30-minute TTL: all live
        ledger.price(request(i, i, Decimal(i) / 10))
    # before: every entry kept until an hour after it died (~0.37 KB each, without a bound)
    assert ledger.num_entries() <= 1_000 + 1_000 // 16
    assert ledger.num_evicted > 0
    t = Decimal(501)
    latest = ledger.price(request(9_000, 4_999, t))  # a recent prefix: still there, a read
    assert latest.read > 0 and not latest.written
    first = ledger.price(request(9_001, 0, t))  # the oldest one went: a write again
    assert first.read == 0 and sum(first.written.values()) > 0


def test_dead_entries_go_before_any_live_one() -> None:
    ledger = CacheLedger("openai", PriceTable.default(), max_entries=100)
    for i in range(90):
        ledger.price(request(i, i, Decimal(0)))
    later = Decimal(3_600)  # every entry above is dead (30-minute TTL), none swept yet
    for i in range(90, 150):
        ledger.price(request(i, i, later))
    assert ledger.num_evicted == 0  # the dead ones made the room
    assert ledger.num_entries() <= 100


def test_no_bound_keeps_the_old_behaviour() -> None:
    ledger = CacheLedger("openai", PriceTable.default())
    for i in range(600):
        ledger.price(request(i, i, Decimal(i)))
    assert ledger.num_entries() == 600 and ledger.num_evicted == 0
