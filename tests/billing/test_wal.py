"""The WAL (group commit, torn tails, one owner), the shipper and the store (idempotent,
exactly-once windows) against a real redis-server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

import kvgate_cli
from cachemap.redis.client import open_redis
from gateway.billing.store import LocalLedger, RedisLedgerStore, Shipper
from gateway.billing.wal import (
    WalLocked,
    WriteAheadLog,
    read_directory,
    read_segment,
    segment_paths,
)
from loadgen.harness.redis_servers import RedisServer, redis_server


def record(i: int, tenant: str = "acme", start: str | None = None) -> dict[str, Any]:
    return {"id": f"req-{i}", "tenant": tenant, "start_unix": start or str(i), "cost": "0.001"}


async def test_appends_are_group_committed_and_durable(tmp_path: Path) -> None:
    wal = WriteAheadLog(tmp_path)
    wal.open()
    await asyncio.gather(*(wal.append(record(i)) for i in range(200)))
    assert wal.num_records == 200
    assert wal.num_syncs < 200  # concurrent appends shared fsyncs
    records, offset, tail = read_segment(segment_paths(tmp_path)[0])
    assert [r["id"] for r in records] == [f"req-{i}" for i in range(200)]
    assert not tail and offset == segment_paths(tmp_path)[0].stat().st_size
    await wal.aclose()


async def test_one_gateway_per_directory_and_a_fresh_segment_after_a_crash(tmp_path: Path) -> None:
    wal = WriteAheadLog(tmp_path)
    wal.open()
    with pytest.raises(WalLocked, match="give each gateway its own billing_wal_dir"):
        WriteAheadLog(tmp_path).open()
    await wal.append(record(1))
    assert wal.current is not None
    torn = wal.current.read_bytes() + b'{"id": "req-2", "ten'  # as kill -9 mid-write leaves it
    wal.current.write_bytes(torn)
    await wal.aclose()
    again = WriteAheadLog(tmp_path)
    again.open()  # never appends after a torn tail
    assert len(segment_paths(tmp_path)) == 2
    await again.append(record(3))
    assert [r["id"] for r in LocalLedger([tmp_path]).query_sync(None, None, None)] == [
        "req-1",
        "req-3",
    ]
    await again.aclose()


async def test_segments_rotate_by_size(tmp_path: Path) -> None:
    wal = WriteAheadLog(tmp_path, segment_bytes=300)
    wal.open()
    for i in range(20):
        await wal.append(record(i))
    assert len(segment_paths(tmp_path)) > 3
    assert len(LocalLedger([tmp_path]).query_sync(None, None, None)) == 20
    await wal.aclose()


def test_windows_are_half_open_and_partition_the_records(tmp_path: Path) -> None:
    lines = [record(i, start=str(Decimal(i) / 2)) for i in range(10)]
    lines.append(record(4, start="2"))  # a replayed duplicate
    (tmp_path / "wal-00000001.jsonl").write_bytes(
        b"".join(__import__("orjson").dumps(r) + b"\n" for r in lines)
    )
    ledger = LocalLedger([tmp_path])
    first = ledger.query_sync("acme", Decimal(0), Decimal(2))
    second = ledger.query_sync("acme", Decimal(2), Decimal(5))
    assert [r["id"] for r in first] == ["req-0", "req-1", "req-2", "req-3"]
    assert [r["id"] for r in second] == [f"req-{i}" for i in range(4, 10)]
    assert ledger.query_sync("globex", None, None) == []


AOF = ("--appendonly", "yes", "--appendfsync", "always")
"""The ledger store's persistence: every acknowledged write is on disk (docs/billing.md)."""


@pytest.fixture
def aof_redis() -> Iterator[RedisServer]:
    with redis_server(port=0, extra=AOF) as server:
        yield server


@pytest.mark.redis
async def test_the_store_is_idempotent_and_the_shipper_replays_after_an_outage(
    tmp_path: Path, aof_redis: RedisServer
) -> None:
    fresh_redis = aof_redis  # killed and restarted below: only the AOF keeps the shipped records
    client = await open_redis(fresh_redis.url, cluster=False)
    store = RedisLedgerStore(client)
    assert await store.put([record(1), record(2)]) == 2
    assert await store.put([record(1), record(2), record(3)]) == 1  # repeats are no-ops
    assert [r["id"] for r in await store.query("acme", None, None)] == ["req-1", "req-2", "req-3"]
    assert [r["id"] for r in await store.query("acme", Decimal(2), Decimal(3))] == ["req-2"]

    wal = WriteAheadLog(tmp_path / "wal", segment_bytes=400)
    wal.open()
    for i in range(10, 20):
        await wal.append(record(i))
    shipper = Shipper(wal, store)
    assert await shipper.ship_once() == 10
    assert len(segment_paths(wal.directory)) == 1  # shipped, finished segments are deleted
    fresh_redis.stop()  # an outage: appends still succeed, shipping fails and keeps its place
    for i in range(20, 25):
        await wal.append(record(i))
    with pytest.raises(Exception):  # noqa: B017 - redis' connection error, after its retries
        await shipper.ship_once()
    fresh_redis.start()
    shipper.offsets.clear()  # as if the offsets file were lost: everything is shipped again
    await shipper.ship_once()
    ids = [r["id"] for r in await store.query("acme", Decimal(10), None)]
    assert ids == [f"req-{i}" for i in range(10, 25)]  # each exactly once
    await wal.aclose()
    await client.aclose()


@pytest.mark.redis
async def test_shipping_while_segments_rotate_loses_nothing(
    tmp_path: Path, aof_redis: RedisServer
) -> None:
    client = await open_redis(aof_redis.url, cluster=False)
    wal = WriteAheadLog(tmp_path / "wal", segment_bytes=500)  # a rotation every ~6 records
    wal.open()
    shipper = Shipper(wal, RedisLedgerStore(client))
    done = asyncio.Event()

    async def ship_continuously() -> None:
        while not done.is_set():
            await shipper.ship_once()
            await asyncio.sleep(0)

    shipping = asyncio.create_task(ship_continuously())
    for start in range(0, 300, 10):
        await asyncio.gather(*(wal.append(record(i)) for i in range(start, start + 10)))
    done.set()
    await shipping
    await shipper.ship_once()
    stored = [r["id"] for r in await RedisLedgerStore(client).query("acme", None, None)]
    assert sorted(stored) == sorted(f"req-{i}" for i in range(300))
    assert len(segment_paths(wal.directory)) == 1  # only the current one is left
    await wal.aclose()
    await client.aclose()


@pytest.mark.redis
async def test_kvgate_billing_ship_takes_over_a_gone_gateways_wal(
    tmp_path: Path, aof_redis: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    gone, live = (
        WriteAheadLog(tmp_path / "pod-a", segment_bytes=400),
        WriteAheadLog(tmp_path / "pod-b"),
    )
    gone.open()
    live.open()
    for i in range(30, 38):
        await gone.append(record(i))
    await gone.aclose()  # its pod is gone: nothing ships this directory any more

    # run in a thread: the command has its own event loop
    def ship(*wal_dir: str) -> int:
        return kvgate_cli.main(["billing", "ship", "--redis-url", aof_redis.url, *wal_dir])

    assert await asyncio.to_thread(ship, "--wal-dir", str(gone.directory)) == 0
    assert "8 records shipped" in capsys.readouterr().out
    client = await open_redis(aof_redis.url, cluster=False)
    try:
        stored = [r["id"] for r in await RedisLedgerStore(client).query("acme", None, None)]
        assert stored == [f"req-{i}" for i in range(30, 38)]
        # again: nothing new; a directory a live gateway holds: refused, nothing shipped
        assert await asyncio.to_thread(ship, "--wal-dir", str(gone.directory)) == 0
        assert "0 records shipped" in capsys.readouterr().out
        assert await asyncio.to_thread(ship, "--wal-dir", str(live.directory)) == 2
        assert "in use by another gateway" in capsys.readouterr().err
        missing = str(tmp_path / "nowhere")
        assert await asyncio.to_thread(ship, "--wal-dir", missing) == 2
        assert "not a billing WAL directory" in capsys.readouterr().err
    finally:
        await client.aclose()
        await live.aclose()


def aborted(i: int) -> dict[str, Any]:
    return {**record(i), "status": "aborted"}


async def test_open_entries_ride_every_new_segment_and_a_restart_settles_them(
    tmp_path: Path,
) -> None:
    """An exchange's open entry (written at its first token) is carried into each new segment
    until it is settled; a crash leaves it unsettled, and the next start writes its aborted
    record once, even after the shipper deleted every finished segment."""
    wal = WriteAheadLog(tmp_path, segment_bytes=300)
    wal.open()
    await wal.open_entry("req-100", aborted(100))
    await wal.open_entry("req-101", aborted(101))
    for i in range(10):
        await wal.append(record(i))
    await wal.append(record(101))  # 101 ends: its own record, then settled
    wal.settle("req-101")
    for i in range(10, 20):
        await wal.append(record(i))
    assert len(segment_paths(tmp_path)) > 4
    assert wal.num_open == 1
    wal.close()  # kill -9: nothing settles req-100
    for path in segment_paths(tmp_path)[:-1]:
        path.unlink()  # shipped and deleted: only the current segment is left
    again = WriteAheadLog(tmp_path)
    again.open()
    assert again.num_recovered == 1
    ids = [r["id"] for r in read_directory(tmp_path)]
    assert ids.count("req-100") == 1  # its aborted record, once
    statuses = {r["id"]: r.get("status") for r in read_directory(tmp_path)}
    assert statuses["req-100"] == "aborted"
    again.close()
    third = WriteAheadLog(tmp_path)
    third.open()
    assert third.num_recovered == 0  # settled by the record the last start wrote
    third.close()


@pytest.mark.redis
async def test_kvgate_billing_ship_settles_a_gone_gateways_open_entries(
    tmp_path: Path, aof_redis: RedisServer
) -> None:
    gone = WriteAheadLog(tmp_path / "pod-a")
    gone.open()
    await gone.append(record(40))
    await gone.open_entry("req-41", aborted(41))  # a stream cut when its pod died
    gone.close()

    def ship() -> int:
        return kvgate_cli.main(
            ["billing", "ship", "--redis-url", aof_redis.url, "--wal-dir", str(gone.directory)]
        )

    assert await asyncio.to_thread(ship) == 0
    client = await open_redis(aof_redis.url, cluster=False)
    try:
        stored = await RedisLedgerStore(client).query("acme", None, None)
    finally:
        await client.aclose()
    assert [(r["id"], r.get("status")) for r in stored] == [
        ("req-40", None),
        ("req-41", "aborted"),
    ]
