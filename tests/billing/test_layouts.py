"""Item 26: the WAL and the ledger store name their layout; a reader takes both layouts this
code knows and refuses, clearly, one it does not."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import orjson
import pytest

from cachemap.redis.client import open_redis
from gateway.billing.store import (
    LAYOUT_KEY,
    BillingLayoutError,
    RedisLedgerStore,
    Shipper,
    check_layout,
)
from gateway.billing.wal import (
    LAYOUT,
    WalLayoutError,
    WriteAheadLog,
    header_line,
    read_directory,
    read_segment,
    segment_paths,
)


def record(i: int) -> dict[str, Any]:
    return {"id": f"req-{uuid.uuid4().hex[:6]}-{i}", "tenant": "acme", "start_unix": str(i)}


def lines(*records: dict[str, Any]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in records)


async def test_segments_name_their_layout_and_both_layouts_are_read(tmp_path: Path) -> None:
    old = [record(1), record(2)]
    (tmp_path / "wal-00000001.jsonl").write_bytes(lines(*old))  # layout 1: no header
    wal = WriteAheadLog(tmp_path)
    wal.open()
    new = record(3)
    await wal.append(new)
    await wal.aclose()
    current = segment_paths(tmp_path)[-1]
    assert current.read_bytes().startswith(header_line(LAYOUT))
    assert current.read_bytes().splitlines()[0] == b'["kvgate-wal",2]'
    assert [r["id"] for r in read_directory(tmp_path)] == [r["id"] for r in [*old, new]]


async def test_a_segment_of_an_unknown_layout_is_refused_never_shipped_never_deleted(
    tmp_path: Path, redis_url: str
) -> None:
    future = tmp_path / "wal-00000001.jsonl"
    future.write_bytes(header_line(99) + lines(record(1)))
    (tmp_path / "wal-00000002.jsonl").write_bytes(header_line(2) + lines(record(2)))
    with pytest.raises(WalLayoutError, match="WAL layout 99; this gateway reads layouts 1, 2"):
        read_segment(future)
    wal = WriteAheadLog(tmp_path)
    wal.open()
    client = await open_redis(redis_url, cluster=False)
    try:
        shipper = Shipper(wal, RedisLedgerStore(client))
        assert await shipper.ship_once() == 1  # the segment it can read, not the other
        assert future.exists() and "wal-00000001.jsonl" in shipper.refused
        assert not (tmp_path / "wal-00000002.jsonl").exists()  # shipped and finished: gone
    finally:
        await wal.aclose()
        await client.aclose()


async def test_the_ledger_store_names_its_layout_and_refuses_an_unknown_one(
    fresh_redis: Any,
) -> None:
    client = await open_redis(fresh_redis.url, cluster=False)
    try:
        assert await check_layout(client, claim=False) == 1  # before versions: no key
        assert await check_layout(client, claim=True) == 2
        assert await client.hget(LAYOUT_KEY, "version") == b"2"
        await client.hset(LAYOUT_KEY, "version", 99)
        with pytest.raises(BillingLayoutError, match="layout 99; this gateway knows layouts"):
            await check_layout(client, claim=True)
    finally:
        await client.aclose()
