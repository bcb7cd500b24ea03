"""The WAL (group commit, torn tails, one owner), the shipper and the store (idempotent,
exactly-once windows) against a real redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

import kvgate_cli
from cachemap.redis.client import open_redis
from gateway.billing.store import LocalLedger, RedisLedgerStore, Shipper
from gateway.billing.wal import (
    WalLocked,
    WalUnavailable,
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
    try:
        # every record is acknowledged, so shipped now: the last one's segment may be mid
        # rotation (seen: the drain read it only up to the next segment's synced size)
        await shipper.ship_once()
        stored = [r["id"] for r in await RedisLedgerStore(client).query("acme", None, None)]
        assert sorted(stored) == sorted(f"req-{i}" for i in range(300))
        await wal.flushed()  # a rotation still in progress ends
        await shipper.ship_once()
        assert len(segment_paths(wal.directory)) == 1  # only the current one is left
    finally:
        await wal.aclose()
        await client.aclose()


class _MemoryStore:
    def __init__(self) -> None:
        self.ids: set[str] = set()

    async def put(self, records: list[dict[str, Any]]) -> int:
        new = {str(r["id"]) for r in records} - self.ids
        self.ids |= new
        return len(new)

    async def query(
        self, tenant: str | None, start: Decimal | None, end: Decimal | None
    ) -> list[dict[str, Any]]:
        raise NotImplementedError


class _SteppedLog(WriteAheadLog):
    """A log whose file work (the worker thread) stops before each of its state changes until
    the test lets it go on: every interleaving of a shipper with the writer, one at a time."""

    stepping = False
    paused: queue.Queue[str]
    go: queue.Queue[bool]

    def step(self, name: str) -> None:
        if self.stepping and threading.current_thread() is not threading.main_thread():
            self.paused.put(name)
            self.go.get()

    def __setattr__(self, name: str, value: object) -> None:
        self.step(name)
        object.__setattr__(self, name, value)

    @contextlib.contextmanager
    def stepped(self) -> Iterator[None]:
        """Step the writer's thread inside; on the way out (a failed assertion too) let it run."""
        self.stepping = True
        try:
            yield
        finally:
            self.stepping = False
            self.go.put(True)  # the thread, if it is stopped
            self.paused.put("done")  # a waiter for its next step, if there is one


async def _writer_steps(wal: _SteppedLog) -> AsyncIterator[str]:
    """The writer thread's state changes, each while the thread is stopped before it (it goes
    on when the next one is asked for), until its flusher is done."""
    name = await asyncio.to_thread(wal.paused.get)
    flusher = wal._flusher
    assert flusher is not None
    while True:
        yield name
        wal.go.put(True)
        step = asyncio.create_task(asyncio.to_thread(wal.paused.get))
        await asyncio.wait((step, flusher), return_when=asyncio.FIRST_COMPLETED)
        if not step.done():  # the writer is done: end the thread waiting for its next step
            wal.paused.put("done")
            await step
            return
        name = step.result()


async def _drain_at_step(directory: Path, at: int) -> tuple[int, set[str]]:
    """Three records, then three more that fill the segment (a rotation follows their commit),
    the writer's thread stopped before each of its state changes; one drain while it is stopped
    at step `at`. Returns the steps the writer made and what that drain missed of what had been
    acknowledged before it."""
    wal = _SteppedLog(directory, segment_bytes=300)
    wal.paused, wal.go = queue.Queue(), queue.Queue()
    wal.open()
    store = _MemoryStore()
    shipper = Shipper(wal, store)
    for i in range(3):
        await wal.append(record(i))
    crossing = {f"req-{i}": asyncio.create_task(wal.append(record(i))) for i in range(3, 6)}
    steps, missed = 0, set[str]()
    with wal.stepped():
        async for _ in _writer_steps(wal):
            steps += 1
            if steps == at:
                acknowledged = {f"req-{i}" for i in range(3)} | {
                    k for k, t in crossing.items() if t.done()
                }
                await shipper.drain()
                missed = acknowledged - store.ids
    await asyncio.gather(*crossing.values())
    await shipper.drain()
    assert store.ids == {f"req-{i}" for i in range(6)}  # and nothing is lost in the end
    await wal.aclose()
    return steps, missed


async def test_a_drain_ships_every_acknowledged_record_at_every_step_of_a_rotation(
    tmp_path: Path,
) -> None:
    # An export drains the shipper to include this gateway's latest records: a record
    # acknowledged before the drain must be in the store after it, wherever the drain falls
    # against the writer's thread (seen: a drain in the middle of a rotation read the old
    # segment only up to the new one's synced size, and missed the last batch).
    at, steps = 1, 2
    while at <= steps:
        steps, missed = await _drain_at_step(tmp_path / f"at-{at}", at)
        assert not missed, f"a drain at the writer's step {at} of {steps} missed {missed}"
        at += 1
    assert steps >= 6  # the write, the sync and the rotation were all stepped through


async def test_a_record_whose_append_missed_its_deadline_is_never_shipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The disk stops with a batch's sync in flight: the append of its older record fails by
    # the deadline (that request is told its billing failed) and, when the sync lands, that
    # record is cut back out — and only that one: its batch's younger record, still in time, is
    # acknowledged and must stay. A shipper running at any step between must not ship the cut
    # record (seen: the landed sync told shippers its bytes were there before they were cut
    # out; and the cut also took the younger record out, acknowledged but not in the log).
    wal = _SteppedLog(tmp_path, deadline_s=0.3)
    wal.paused, wal.go = queue.Queue(), queue.Queue()
    wal.open()
    cut = os.ftruncate

    def stepped_cut(fd: int, size: int) -> None:  # the cut is a step of its own
        wal.step("ftruncate")
        cut(fd, size)

    monkeypatch.setattr(os, "ftruncate", stepped_cut)
    store = _MemoryStore()
    shipper = Shipper(wal, store)
    await wal.append(record(1))

    async def in_time() -> None:  # submitted just after, with all the time it needs
        wal.deadline_s = 60.0
        await wal.append(record(3))

    with wal.stepped():
        late = asyncio.create_task(wal.append(record(2)))
        younger = asyncio.create_task(in_time())  # the same batch: the flusher starts after
        steps = _writer_steps(wal)
        seen = [await anext(steps)]  # the writer is stopped: the older append's deadline passes
        with pytest.raises(WalUnavailable):
            await late
        await shipper.drain()
        async for name in steps:
            seen.append(name)
            await shipper.drain()
            assert "req-2" not in store.ids, f"shipped before the writer's step {seen}"
    await younger
    await wal.append(record(4))
    await shipper.drain()
    assert [r["id"] for r in read_directory(tmp_path)] == ["req-1", "req-3", "req-4"]
    assert store.ids == {"req-1", "req-3", "req-4"}
    assert "ftruncate" in seen  # the sync landed, then the cut was made
    await wal.aclose()


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
