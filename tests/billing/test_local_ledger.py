"""Exports straight from WAL directories (no ledger store): read off the event loop."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import orjson

from gateway.billing.store import LocalLedger

UNBLOCK_AFTER_S = 5.0
"""The watchdog's delay: a reader on the event loop blocks it until then (a bound, not a sync)."""


async def test_a_local_export_reads_the_segments_off_the_event_loop(tmp_path: Path) -> None:
    """Item 17: an export without a store read every WAL segment on the event loop, stalling
    every request meanwhile. The segment here is a FIFO: reading it blocks until a writer
    comes. The event loop must keep running (and be the one to write) while the export reads."""
    fifo = tmp_path / "wal-00000001.jsonl"
    os.mkfifo(fifo)
    record = {"id": "req-1", "tenant": "acme", "start_unix": "1", "cost": "0.001"}
    line = orjson.dumps(record) + b"\n"
    rescued = threading.Event()

    def watchdog() -> None:  # only if the loop is stuck: unblock the reader so the test ends
        if not written.wait(UNBLOCK_AFTER_S):
            rescued.set()
            with open(fifo, "wb") as f:
                f.write(line)

    written = threading.Event()
    guard = threading.Thread(target=watchdog, daemon=True)
    guard.start()
    export = asyncio.create_task(LocalLedger([tmp_path]).query(None, None, None))
    writer = None
    for _ in range(int(UNBLOCK_AFTER_S / 0.01)):  # the reader has opened the FIFO
        await asyncio.sleep(0.01)
        try:
            writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:
            continue
    if writer is not None:
        os.write(writer, line)
        os.close(writer)
        written.set()
    records = await asyncio.wait_for(export, 10)
    guard.join(timeout=10)
    assert not rescued.is_set(), "the export blocked the event loop"
    assert [r["id"] for r in records] == ["req-1"]
