"""One record per exchange, even when the exchange is cancelled while its record is written.

The drain's grace ends in uvicorn cancelling the request tasks still running. A task cancelled
while the meter's `on_usage` waits for its record's fsync leaves that write in flight (the WAL
shields it: a write cannot be taken back half way), and the exchange's `finish` then ran
`on_finish`, which saw the exchange unbilled and wrote its `aborted` record too: the one id
twice in the WAL that `kvgate chaos --scenario gateway-killed` found in 1 of 20 drains. Pinned
here with the real meter over a real WAL directory, the cancellation landing while the record's
write is in flight (`WriteAheadLog.num_in_flight`), so it fails every time rather than once in
twenty drains.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import orjson

from gateway.api.openai.parse import parse_chat
from gateway.billing.meter import BillingMeter
from gateway.billing.pricing.prices import load_price_table
from gateway.billing.wal import WriteAheadLog, read_directory, unsettled
from gateway.request.state import ExchangeRecord, Routed
from gateway.request.usage import EngineUsage
from gateway.tenancy.registry import TenantRegistry
from router.types import Decision, RouteRequest
from tests.conftest import MODEL, TENANT_KEY, gateway_settings

MAX_TURNS = 100


def _meter(tmp_path: Path) -> tuple[BillingMeter, ExchangeRecord]:
    settings = gateway_settings(
        ["http://127.0.0.1:9"],
        billing_wal_dir=tmp_path,
        billing_model_map={MODEL: "gpt-5.6"},
    )
    wal = WriteAheadLog(tmp_path)
    wal.open()
    meter = BillingMeter(settings, load_price_table(settings.billing_prices_file), wal)
    tenant = TenantRegistry.from_pairs(settings.secret_bytes(), settings.tenants).authenticate(
        TENANT_KEY
    )
    body = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 400}]}
    parsed = meter.prepare_sync(parse_chat(orjson.dumps(body), settings.max_prompt_bytes), tenant)
    routed = Routed(
        parsed, tenant, (), RouteRequest(1, 400.0), Decision(("r0",), "no_match"), {}, 0.0, 0.0
    )
    return meter, ExchangeRecord(routed, "r0")


async def _cancelled_while_recording(meter: BillingMeter, record: ExchangeRecord) -> None:
    """`on_usage` cancelled (the drain's grace) while its record's write is in flight."""
    usage = EngineUsage.parse({"prompt_tokens": 400, "completion_tokens": 16})
    task = asyncio.create_task(meter.on_usage(record, usage))
    for _ in range(MAX_TURNS):  # turns of the loop (no clock): until the record is submitted
        if meter.wal.num_in_flight:
            break
        await asyncio.sleep(0)
    assert meter.wal.num_in_flight == 1  # its record's write is in flight: cancel it there
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    else:  # the record landed before the cancellation: not the case under test
        raise AssertionError("on_usage finished before it was cancelled")


async def test_an_exchange_cancelled_while_its_record_is_written_is_recorded_once(
    tmp_path: Path,
) -> None:
    meter, record = _meter(tmp_path)
    await meter.on_first_token(record)
    await _cancelled_while_recording(meter, record)
    record.ok = False
    await meter.on_finish(record)  # the exchange's `finally`, as the cut stream runs it
    await meter.wal.aclose()
    records = list(read_directory(tmp_path))
    counts = Counter(r["id"] for r in records)
    assert list(counts.values()) == [1], [(r["id"], r["status"]) for r in records]
    # the record that landed is the one with the engine's usage; nothing is left to recover
    assert [r["status"] for r in records] == ["ok"]
    assert unsettled(tmp_path) == []


async def test_an_exchange_that_ends_without_usage_is_recorded_once_as_aborted(
    tmp_path: Path,
) -> None:
    """The guard beside it: an exchange with no record in flight is still billed at its end."""
    meter, record = _meter(tmp_path)
    await meter.on_first_token(record)
    await meter.on_finish(record)  # no usage at all: the aborted record, once
    await meter.wal.aclose()
    assert [r["status"] for r in read_directory(tmp_path)] == ["aborted"]
    assert unsettled(tmp_path) == []
