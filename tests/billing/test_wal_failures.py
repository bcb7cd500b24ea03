"""The WAL when the disk fails under it (issue 14, item 16): a write that fails part way leaves no
torn bytes for the next batch to be glued to, no record of a failed batch is ever read back, and
an append that cannot finish in time fails by its deadline and is never written.

The disk fills for real: a child process whose file-size limit (RLIMIT_FSIZE, with SIGXFSZ
ignored) stops its writes part way, exactly as a full disk does — a short write, then EFBIG —
and is then raised again, as when space is freed."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gateway.billing.wal import WriteAheadLog, read_directory, segment_paths

ROOT = Path(__file__).resolve().parents[2]


def record(i: int) -> dict[str, Any]:
    return {
        "id": f"req-{i}",
        "tenant": "acme",
        "start_unix": str(i),
        "cost": "0.001",
        "pad": "x" * 80,
    }


def fill_the_disk(directory: str, limit: int, groups: int, size: int, after: int) -> None:
    """In a child process: append `groups` groups of `size` concurrent records under a file-size
    limit of `limit` bytes, lift the limit, append `after` more; print each record's outcome."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a full disk: the write fails with EFBIG
    wal = WriteAheadLog(Path(directory))
    wal.open()
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    outcomes: dict[str, str] = {}

    async def one(i: int) -> None:
        try:
            await wal.append(record(i))
            outcomes[f"req-{i}"] = "ok"
        except OSError:  # WalUnavailable
            outcomes[f"req-{i}"] = "failed"

    async def run() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        for g in range(groups):
            await asyncio.gather(*(one(g * size + k) for k in range(size)))
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # space is freed
        for i in range(groups * size, groups * size + after):
            await one(i)
        await wal.aclose()

    asyncio.run(run())
    print(json.dumps(outcomes))


def run_child(directory: Path, limit: int, groups: int, size: int, after: int) -> dict[str, str]:
    code = (
        "from tests.billing.test_wal_failures import fill_the_disk; "
        f"fill_the_disk({str(directory)!r}, {limit}, {groups}, {size}, {after})"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    outcomes: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    return outcomes


@pytest.mark.parametrize("size", [1, 5], ids=["one-record-batches", "group-commits"])
def test_a_disk_that_fills_part_way_through_a_write_loses_no_acknowledged_record(
    tmp_path: Path, size: int
) -> None:
    line = len(json.dumps(record(0), separators=(",", ":"))) + 1
    limit = 7 * line + line // 2  # the 8th record's write stops half way
    outcomes = run_child(tmp_path / "wal", limit, groups=20 // size, size=size, after=5)
    acknowledged = {i for i, o in outcomes.items() if o == "ok"}
    failed = {i for i, o in outcomes.items() if o == "failed"}
    assert failed  # the disk filled
    assert all(outcomes[f"req-{i}"] == "ok" for i in range(20, 25))  # then space came back
    in_log = [r["id"] for r in read_directory(tmp_path / "wal")]
    # before: the first record after the space came back was glued to the torn bytes, so the
    # reader skipped it (an acknowledged record lost), and a failed batch's complete lines
    # were read back (records whose requests had failed)
    assert sorted(in_log) == sorted(acknowledged)
    for path in segment_paths(tmp_path / "wal"):
        data = path.read_bytes()
        assert not data or data.endswith(b"\n")  # nothing torn left
        assert all(json.loads(raw) for raw in data.splitlines())


async def test_an_append_that_cannot_finish_fails_by_its_deadline_and_is_never_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that stops (an fdatasync that takes 1.5 s, injected at the OS call): the append
    fails after its 0.3-s deadline, and when the sync does land its record is cut back out."""
    from gateway.billing.wal import WalUnavailable

    wal = WriteAheadLog(tmp_path, deadline_s=0.3)
    wal.open()
    await wal.append(record(1))
    real = os.fdatasync

    def stalled(fd: int) -> None:
        time.sleep(1.5)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", stalled)
    started = time.monotonic()
    with pytest.raises(WalUnavailable, match=r"within 0\.3 s"):
        await wal.append(record(2))
    assert time.monotonic() - started < 1.0
    monkeypatch.setattr(os, "fdatasync", real)
    await wal.flushed()  # the stalled sync lands; its record is cut back out
    await wal.append(record(3))
    await wal.aclose()
    assert [r["id"] for r in read_directory(tmp_path)] == ["req-1", "req-3"]
