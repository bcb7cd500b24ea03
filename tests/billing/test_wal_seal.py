"""A record reported as failed is never shipped (issue 45, item 2): when a truncation fails, the
bytes of a failed write could stay in a segment and be read back — `_replace` raised straight out
of a failed `ftruncate`, and `_cut` moved to a new segment leaving the old one to be read to its
end — so the record won its id over the `aborted` record the meter writes for the withheld
response, and the tenant was billed the full price. Now every truncation goes through the cut,
and a segment left behind is sealed at its good size.

The disk's failures are injected by replacing `os.fdatasync` / `os.ftruncate` with versions that
fail once (the fault injection the issue asks for); the store is a real redis-server."""

from __future__ import annotations

import errno
import os
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cachemap.redis.client import open_redis
from gateway.billing.store import LocalLedger, RedisLedgerStore, Shipper
from gateway.billing.wal import (
    WalUnavailable,
    WriteAheadLog,
    read_directory,
    seal_of,
    segment_paths,
)

pytestmark = pytest.mark.redis

RELEASE_TIMEOUT_S = 10.0


def record(i: int, tenant: str, status: str) -> dict[str, Any]:
    cost = "0.0100" if status == "complete" else "0.0010"
    # ids are global in the store (the session's Redis): each test's tenant makes its own
    return {
        "id": f"{tenant}:req-{i}",
        "tenant": tenant,
        "start_unix": str(i),
        "status": status,
        "cost": cost,
    }


def fail_once(real: Callable[..., None], *, before: Callable[[], None] | None = None) -> Any:
    """`real`, except that its first call (after `before`, if given) raises EIO."""
    armed = [True]

    def patched(*args: Any) -> None:
        if armed[0]:
            armed[0] = False
            if before is not None:
                before()
            raise OSError(errno.EIO, "injected")
        real(*args)

    return patched


async def ship_and_read(wal: WriteAheadLog, redis_url: str, tenant: str) -> dict[str, str]:
    """Ship the WAL to the store; each id's stored status (the first copy wins there)."""
    client = await open_redis(redis_url, cluster=False)
    try:
        store = RedisLedgerStore(client)
        await Shipper(wal, store).ship_once()
        stored = await store.query(tenant, None, None)
        return {r["id"].removeprefix(f"{tenant}:"): r["status"] for r in stored}
    finally:
        await client.aclose()


async def test_a_failed_truncate_after_a_given_up_sync_does_not_ship_the_record(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record's sync outlasts its deadline (its waiter gives up: 503, aborted), the cut of
    its bytes (`_replace`) fails once."""
    tenant = f"seal-{uuid.uuid4().hex[:8]}"
    wal = WriteAheadLog(tmp_path / "wal", deadline_s=0.2)
    wal.open()
    release = threading.Event()
    real_sync = os.fdatasync
    slow = [True]

    def slow_sync(fd: int) -> None:
        if slow[0]:
            slow[0] = False
            release.wait(RELEASE_TIMEOUT_S)  # the disk stalls until the waiter has given up
        real_sync(fd)

    monkeypatch.setattr(os, "fdatasync", slow_sync)
    monkeypatch.setattr(os, "ftruncate", fail_once(os.ftruncate))
    try:
        with pytest.raises(WalUnavailable):
            await wal.append(record(1, tenant, "complete"))
        release.set()
        await wal.flushed()
        await wal.append(record(1, tenant, "aborted"))  # what the meter writes for it
        await wal.append(record(2, tenant, "complete"))
        assert await ship_and_read(wal, redis_url, tenant) == {
            "req-1": "aborted",
            "req-2": "complete",
        }
    finally:
        release.set()
        await wal.aclose()


async def test_a_failed_sync_whose_cut_fails_seals_the_segment_before_the_record(
    tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record's fdatasync fails, and so does the cut (`ftruncate`): the log moves to a new
    segment, and the old one, holding the record's complete line, is sealed before it."""
    tenant = f"seal-{uuid.uuid4().hex[:8]}"
    wal = WriteAheadLog(tmp_path / "wal")
    wal.open()
    await wal.append(record(0, tenant, "complete"))
    monkeypatch.setattr(os, "ftruncate", fail_once(os.ftruncate))
    monkeypatch.setattr(os, "fdatasync", fail_once(os.fdatasync))
    try:
        with pytest.raises(WalUnavailable):
            await wal.append(record(1, tenant, "complete"))
        await wal.append(record(1, tenant, "aborted"))
        first, second = segment_paths(wal.directory)
        assert (
            f'"{tenant}:req-1"'.encode() in first.read_bytes()
        )  # the failed write is still there...
        seal = seal_of(second)
        assert seal is not None and seal[0] == first.name
        assert seal[1] < first.stat().st_size  # ...past the seal
        # without a store (the WAL is the ledger), in `kvgate billing inspect`, and in the store
        assert [(r["id"], r["status"]) for r in read_directory(wal.directory)] == [
            (f"{tenant}:req-0", "complete"),
            (f"{tenant}:req-1", "aborted"),
        ]
        local = await LocalLedger([wal.directory]).query(tenant, None, None)
        assert [r["status"] for r in local] == ["complete", "aborted"]
        assert await ship_and_read(wal, redis_url, tenant) == {
            "req-0": "complete",
            "req-1": "aborted",
        }
        assert segment_paths(wal.directory) == [second]  # the sealed one is shipped and gone
    finally:
        await wal.aclose()


async def test_a_restart_reads_a_sealed_segment_up_to_its_seal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An open entry whose record's write failed is billed as aborted by the next start over
    the directory: the failed line past the seal does not settle it."""
    wal = WriteAheadLog(tmp_path / "wal")
    wal.open()
    await wal.open_entry("acme:req-1", record(1, "acme", "aborted"))
    monkeypatch.setattr(os, "ftruncate", fail_once(os.ftruncate))
    monkeypatch.setattr(os, "fdatasync", fail_once(os.fdatasync))
    with pytest.raises(WalUnavailable):
        await wal.append(record(1, "acme", "complete"))
    monkeypatch.undo()
    await wal.aclose()  # a crash before the meter wrote its aborted record
    again = WriteAheadLog(tmp_path / "wal")
    again.open()
    await again.aclose()
    assert again.num_recovered == 1
    statuses = [(r["id"], r["status"]) for r in read_directory(tmp_path / "wal")]
    assert statuses == [("acme:req-1", "aborted")]


async def test_a_rotation_after_the_log_broke_leaves_the_new_segment_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sync fails, the cut fails, the next segment cannot be created: the log is broken
    (every write first retries the cut). A rotation that then succeeds (the segment was full)
    ends that: before, the retried cut truncated the *new* segment to the old one's good size,
    padding it with NULs that glued themselves to the next acknowledged record (unreadable:
    lost)."""
    wal = WriteAheadLog(tmp_path / "wal", segment_bytes=300)
    wal.open()
    await wal.append(record(0, "acme", "complete"))
    real_open = os.open
    refused = [True]

    def open_refusing_a_segment_once(path: Any, flags: int, mode: int = 0o777) -> int:
        if refused[0] and Path(path).name.startswith("wal-"):
            refused[0] = False
            raise OSError(errno.ENOSPC, "injected")
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "fdatasync", fail_once(os.fdatasync))
    monkeypatch.setattr(os, "ftruncate", fail_once(os.ftruncate))
    monkeypatch.setattr(os, "open", open_refusing_a_segment_once)
    big = {**record(1, "acme", "complete"), "pad": "x" * 300}  # the segment is full after it
    with pytest.raises(WalUnavailable):
        await wal.append(big)
    await wal.flushed()  # the rotation of the full segment, which succeeds
    monkeypatch.undo()
    await wal.append(record(2, "acme", "complete"))
    await wal.aclose()
    assert [r["id"] for r in read_directory(tmp_path / "wal")] == ["acme:req-0", "acme:req-2"]
