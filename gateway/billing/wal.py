"""The write-ahead log: one gateway's billing records, durable before the response completes.

    <dir>/LOCK                     flock'd by the one gateway that owns the directory
    <dir>/wal-00000001.jsonl       append-only segments, one JSON record per line, after a
                                   header line ["kvgate-wal", <layout>]
    <dir>/shipped.json             how far each segment has been shipped (advisory)

Layouts (`LAYOUT`): 1 has no header (segments written before layouts were versioned); 2 starts
each segment with its header, a JSON array — which a layout-1 reader skips as it skips any line
that is not a record, so a gateway of either layout reads the other's segments (a rolling
upgrade or a rollback over one WAL directory loses nothing). A segment whose header names a
layout this code does not know is refused (`WalLayoutError`): never shipped, never deleted.

Invariants:
- `append` returns only after the record's bytes are written and fdatasync'd (group commit:
  records appended while a sync is in progress share the next one), so a record acknowledged
  to the meter survives `kill -9` of the gateway and a power loss.
- A line without its newline is a torn write from a crash: never acknowledged, so readers skip
  it, and a restarted writer always opens a fresh segment rather than appending after it.
- Records carry their own id; readers and the shared store deduplicate on it, so replaying a
  segment any number of times is harmless.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024
"""64 MiB per segment (~100k records of ~600 bytes): shipped segments are deleted whole."""
_SEGMENT = re.compile(r"^wal-(\d{8})\.jsonl$")
LAYOUT = 2
"""The layout this code writes (see the module docstring)."""
KNOWN_LAYOUTS = (1, 2)
HEADER_TAG = "kvgate-wal"


class WalLocked(RuntimeError):
    """Another process owns this WAL directory."""


class WalLayoutError(ValueError):
    """A segment of a layout this code does not know: it must be read by a newer gateway."""


def header_line(layout: int = LAYOUT) -> bytes:
    return orjson.dumps([HEADER_TAG, layout]) + b"\n"


def segment_layout(first_line: bytes) -> int:
    """The layout a segment's first line declares: 1 when it is not a header (a record)."""
    try:
        value = orjson.loads(first_line)
    except orjson.JSONDecodeError:
        return 1
    if isinstance(value, list) and len(value) == 2 and value[0] == HEADER_TAG:
        return int(value[1]) if isinstance(value[1], int) else -1
    return 1


def segment_paths(directory: Path) -> list[Path]:
    """The directory's segments in write order."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _SEGMENT.match(p.name))]
    return [p for _, p in sorted(found)]


def read_segment(path: Path, offset: int = 0) -> tuple[list[dict[str, Any]], int, bool]:
    """Complete records from `offset`: (records, offset after the last complete line, whether
    bytes follow that are not a complete line — a torn tail, or a write in progress)."""
    with open(path, "rb") as f:
        if offset:
            f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    if offset == 0 and end:
        layout = segment_layout(data[: data.find(b"\n")])
        if layout not in KNOWN_LAYOUTS:
            raise WalLayoutError(
                f"{path} has WAL layout {layout}; this gateway reads layouts "
                f"{', '.join(map(str, KNOWN_LAYOUTS))}: read it with the gateway that wrote it"
            )
    records = []
    for line in data[:end].split(b"\n"):
        if not line:
            continue
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # a torn line later overwritten is impossible (append-only); skip noise
        if isinstance(record, dict):
            records.append(record)
    return records, offset + end, end < len(data)


def read_directory(directory: Path) -> Iterator[dict[str, Any]]:
    """Every complete record in a directory's segments, in write order (duplicates included)."""
    for path in segment_paths(directory):
        records, _, _ = read_segment(path)
        yield from records


class WriteAheadLog:
    """The fsync'd, group-committed, append-only log of one gateway (see the module docstring)."""

    def __init__(self, directory: Path, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> None:
        if segment_bytes <= 0:
            raise ValueError("segment_bytes must be positive")
        self.directory = directory
        self.segment_bytes = segment_bytes
        self._lock_fd: int | None = None
        self._fd: int | None = None
        self._size = 0
        self.current: Path | None = None
        self._pending: list[tuple[bytes, asyncio.Future[None]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self.num_syncs = 0
        self.num_records = 0

    # -- lifecycle -----------------------------------------------------------------------------
    def open(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(self.directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            raise WalLocked(
                f"the billing WAL directory {self.directory} is in use by another gateway; "
                "give each gateway its own billing_wal_dir"
            ) from None
        self._lock_fd = lock_fd
        self._rotate()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def _rotate(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        existing = segment_paths(self.directory)
        number = int(_SEGMENT.match(existing[-1].name).group(1)) + 1 if existing else 1  # type: ignore[union-attr]
        path = self.directory / f"wal-{number:08d}.jsonl"
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        header = header_line()
        os.write(self._fd, header)  # before any record: a segment always names its layout
        os.fdatasync(self._fd)
        self._size = len(header)
        self.current = path
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the new segment's name is durable too
        finally:
            os.close(dir_fd)

    # -- writing -------------------------------------------------------------------------------
    async def append(self, record: dict[str, Any]) -> None:
        """Write one record; return once it is on stable storage."""
        await self.append_line(orjson.dumps(record) + b"\n")

    async def append_line(self, line: bytes) -> None:
        if self._fd is None:
            raise RuntimeError("the WAL is not open")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((line, future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        await future

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            data = b"".join(line for line, _ in batch)
            try:
                await asyncio.to_thread(self._write, data)
            except Exception as exc:  # a failed sync fails every record in it
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            self.num_syncs += 1
            self.num_records += len(batch)
            for _, future in batch:
                if not future.done():
                    future.set_result(None)

    def _write(self, data: bytes) -> None:
        fd = self._fd
        assert fd is not None
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fdatasync(fd)
        self._size += len(data)
        if self._size >= self.segment_bytes:
            self._rotate()

    async def aclose(self) -> None:
        if self._flusher is not None:
            with contextlib.suppress(Exception):
                await self._flusher
        self.close()
