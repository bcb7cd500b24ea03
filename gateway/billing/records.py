"""The ledger record: one per request (and one per explicit-cache operation), JSON-ready.

Money and ratios are exact decimal strings; counts are integers; times are both ISO-8601 UTC
(`start`, `first_token`) and exact unix seconds (`start_unix`, the export index). `id` is the
idempotency key everywhere (the WAL, the store, exports).
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from gateway.billing.pricing.model import Charge
from gateway.billing.pricing.money import ZERO, iso, plain

KINDS = ("request", "cache.create", "cache.update", "cache.delete")
STATUSES = ("ok", "aborted", "unpriced")
"""ok: billed from the engine's usage; aborted: the exchange ended before its usage arrived,
billed from estimates with no output; unpriced: no price for the model (zero cost, flagged)."""

COLUMNS = (
    "id",
    "kind",
    "status",
    "tenant",
    "profile",
    "model",
    "price_model",
    "start",
    "start_unix",
    "first_token",
    "prompt_tokens",
    "uncached_tokens",
    "read_tokens",
    "written_tokens",
    "write_tiers",
    "output_tokens",
    "iet",
    "peak_multiplier",
    "input_cost",
    "output_cost",
    "rent",
    "cost",
    "currency",
    "cached_content",
    "replica",
    "engine_cached_tokens",
    "gateway",
    "usage",
    "queue_ms",
)
"""Every record has exactly these keys; CSV and Parquet columns in this order. `queue_ms` (the
time the request waited in flow control's queue before it started, whole milliseconds) came
last: records written before it lack the key, and every reader takes a missing column as empty
(None), so old WAL segments and stored records stay readable."""
INT_COLUMNS = frozenset(
    {
        "prompt_tokens",
        "uncached_tokens",
        "read_tokens",
        "written_tokens",
        "output_tokens",
        "engine_cached_tokens",
        "queue_ms",
    }
)
MONEY_COLUMNS = ("input_cost", "output_cost", "rent", "cost")
JSON_COLUMNS = frozenset({"write_tiers", "usage"})


def build_record(
    *,
    record_id: str,
    kind: str,
    status: str,
    tenant: str,
    profile: str,
    model: str,
    price_model: str | None,
    start: Decimal,
    first_token: Decimal | None,
    charge: Charge | None,
    usage: dict[str, Any] | None = None,
    cached_content: str | None = None,
    replica: str | None = None,
    engine_cached_tokens: int | None = None,
    gateway: str | None = None,
    queue_s: float | None = None,
) -> dict[str, Any]:
    assert kind in KINDS and status in STATUSES
    record: dict[str, Any] = {
        "id": record_id,
        "kind": kind,
        "status": status,
        "tenant": tenant,
        "profile": profile,
        "model": model,
        "price_model": price_model,
        "start": iso(start),
        "start_unix": plain(start),
        "first_token": iso(first_token) if first_token is not None else None,
        "prompt_tokens": charge.num_prompt_tokens if charge else 0,
        "uncached_tokens": charge.uncached if charge else 0,
        "read_tokens": charge.read if charge else 0,
        "written_tokens": charge.num_written if charge else 0,
        "write_tiers": dict(charge.written) if charge else {},
        "output_tokens": charge.num_output_tokens if charge else 0,
        "iet": plain(charge.input_equivalent_tokens) if charge else "0",
        "peak_multiplier": plain(charge.peak_multiplier) if charge else "1",
        "input_cost": plain(charge.input_cost) if charge else "0",
        "output_cost": plain(charge.output_cost) if charge else "0",
        "rent": plain(charge.rent) if charge else "0",
        "cost": plain(charge.cost) if charge else "0",
        "currency": "USD",
        "cached_content": cached_content,
        "replica": replica,
        "engine_cached_tokens": engine_cached_tokens,
        "gateway": gateway,
        "usage": usage or {},
        "queue_ms": round(queue_s * 1e3) if queue_s is not None else None,
    }
    assert tuple(record) == COLUMNS
    return record


def money(record: dict[str, Any], column: str) -> Decimal:
    value = record.get(column)
    return Decimal(str(value)) if value not in (None, "") else ZERO
