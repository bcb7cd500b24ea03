"""The ledger store must be durable before a shipped segment is deleted (issue 45, item 1): a store
that does not fsync every write is refused at start (unless an operator accepts it, by name),
WAITAOF confirms each put where the server has it (Redis >= 7.2), and an AOF store killed with
SIGKILL right after a ship, restarted from its append-only file, holds every acknowledged id."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cachemap.redis.client import open_redis
from gateway.billing.service import Billing
from gateway.billing.store import (
    BillingDurabilityError,
    RedisLedgerStore,
    Shipper,
    check_durability,
    ship_directories,
    supports_waitaof,
)
from gateway.billing.wal import WriteAheadLog, segment_paths
from gateway.settings import Settings
from loadgen.harness.redis_servers import RedisServer, redis_server
from tests.billing.test_wal import AOF

pytestmark = pytest.mark.redis

EVERYSEC = ("--appendonly", "yes", "--appendfsync", "everysec")


def record(i: int) -> dict[str, Any]:
    return {"id": f"req-{i}", "tenant": "acme", "start_unix": str(i), "cost": "0.001"}


@pytest.fixture
def everysec_redis() -> Iterator[RedisServer]:
    with redis_server(port=0, extra=EVERYSEC) as server:
        yield server


def billing_settings(tmp_path: Path, url: str, **extra: Any) -> Settings:
    return Settings(billing_wal_dir=tmp_path / "wal", billing_redis_url=url, **extra)


async def test_a_store_with_appendfsync_everysec_is_refused_at_start(
    tmp_path: Path, everysec_redis: RedisServer
) -> None:
    billing = Billing(billing_settings(tmp_path, everysec_redis.url))
    with pytest.raises(BillingDurabilityError) as refused:
        await billing.start()
    await billing.stop()
    message = str(refused.value)
    assert "appendfsync everysec" in message and "appendfsync always" in message
    assert "billing_redis_allow_unsafe_fsync" in message  # the way out, by name
    with pytest.raises(BillingDurabilityError, match="appendfsync everysec"):
        await ship_directories([], everysec_redis.url)  # `kvgate billing ship` too


async def test_a_store_without_the_append_only_file_is_refused(
    tmp_path: Path, fresh_redis: RedisServer
) -> None:
    billing = Billing(billing_settings(tmp_path, fresh_redis.url))
    with pytest.raises(BillingDurabilityError, match="appendonly no"):
        await billing.start()
    await billing.stop()


async def test_an_operator_may_accept_a_store_that_does_not_fsync(
    tmp_path: Path, everysec_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    settings = billing_settings(tmp_path, everysec_redis.url, billing_redis_allow_unsafe_fsync=True)
    billing = Billing(settings)
    await billing.start()
    try:
        assert billing.shipper is not None
        assert "appendfsync everysec" in caplog.text  # said once, at start
    finally:
        await billing.stop()


def test_waitaof_is_used_from_redis_7_2() -> None:
    assert not supports_waitaof("7.0.15")
    assert not supports_waitaof("6.2.14")
    assert supports_waitaof("7.2.0")
    assert supports_waitaof("7.4.1")
    assert supports_waitaof("8.0.0")


async def test_this_machines_redis_is_checked_by_its_settings(aof_redis: RedisServer) -> None:
    client = await open_redis(aof_redis.url, cluster=False)
    try:
        found = await check_durability(client, allow_unsafe=False)
        version = aof_redis.cli("info", "server").split("redis_version:")[1].split()[0]
        assert found.version == version
        assert found.wait_aof == supports_waitaof(version)
    finally:
        await client.aclose()


@pytest.fixture
def aof_redis() -> Iterator[RedisServer]:
    with redis_server(port=0, extra=AOF) as server:
        yield server


async def test_kill_9_right_after_a_ship_keeps_every_acknowledged_id(
    tmp_path: Path, aof_redis: RedisServer
) -> None:
    client = await open_redis(aof_redis.url, cluster=False)
    durability = await check_durability(client, allow_unsafe=False)
    wal = WriteAheadLog(tmp_path / "wal", segment_bytes=400)
    wal.open()
    try:
        for i in range(40):
            await wal.append(record(i))
        shipper = Shipper(wal, RedisLedgerStore(client, wait_aof=durability.wait_aof))
        assert await shipper.ship_once() == 40
        assert len(segment_paths(wal.directory)) == 1  # the finished segments are gone
        aof_redis.stop()  # SIGKILL, at once: no shutdown, no final fsync
        aof_redis.start()  # from its append-only file
        stored = [r["id"] for r in await RedisLedgerStore(client).query("acme", None, None)]
        assert sorted(stored) == sorted(f"req-{i}" for i in range(40))
    finally:
        await wal.aclose()
        await client.aclose()
