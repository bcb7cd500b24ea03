"""The write-ahead log: one gateway's billing records, durable before the response completes.

    <dir>/LOCK                     flock'd by the one gateway that owns the directory
    <dir>/LEASE                    the wall-clock time its owner last renewed it (unix s)
    <dir>/wal-00000001.jsonl       append-only segments, one JSON value per line, after a
                                   header line ["kvgate-wal", <layout>]
    <dir>/shipped.json             how far each segment has been shipped (advisory)

A line is a record (a JSON object: `gateway.billing.records`, what is billed, with its `id`),
or one of the log's own JSON arrays: the header, or an open entry `["kvgate-open", "<id>",
{record}]` — an exchange that has had its first token, with the record it is billed by if it
never ends (the `aborted` one).

A segment that follows another starts, after its header, with the previous one's seal
`["kvgate-seal", "<previous segment>", <good size>]`: where the previous segment's acknowledged
bytes end. Bytes past it are a write that failed and could not be cut back out (its records were
reported failed, and their exchanges billed as aborted): readers of a finished segment read it
only up to its seal. A segment without one (the last of a crashed run, or written before seals)
is read to its last complete line.

Layouts (`LAYOUT`): 1 has no header (segments written before layouts were versioned); 2 starts
each segment with its header. The log's own lines are arrays, which a layout-1 reader skips as
it skips any line that is not a record, so a gateway of either layout reads the other's
segments (a rolling upgrade or a rollback over one WAL directory loses nothing — but a layout-1
gateway taking over a crashed layout-2 directory does not bill its open entries). A segment
whose header names a layout this code does not know is refused (`WalLayoutError`): never
shipped, never deleted.

Invariants:
- `append` returns only after the record's bytes are written and fdatasync'd (group commit:
  records appended while a sync is in progress share the next one), so a record acknowledged
  to the meter survives `kill -9` of the gateway and a power loss; and it returns within
  `deadline_s`, else raises `WalUnavailable` — and that record is never in the log (a write
  still in flight when its deadline passed is cut back out when it lands).
- A failed write leaves nothing behind: the segment is cut back to its last good size (when
  even that fails, the log moves on to a new segment whose seal ends the old one at that size),
  so no later line is glued to a torn one, no reader sees a line of it, and every record of the
  failed batch fails with `WalUnavailable`. Every truncation goes through that one cut.
- Shippers read `synced`, (the current segment, its bytes on stable storage), as one value: a
  record is in it from the moment its append returns, and a record cut back out never was
  (the size is published only after the cut, in the same step as the waiters are told).
- Readers see records only. A line without its newline is a torn write from a crash: never
  acknowledged, skipped; a restarted writer always opens a fresh segment.
- Every open entry not yet settled is in the current segment (a new segment starts with them,
  carried over), so after a crash the last two segments hold all of them; `open` (the next
  start over the directory, and `kvgate billing ship`) appends the aborted record of each one
  no record settles.
- Records carry their own id; readers and the shared store deduplicate on it, so replaying a
  segment any number of times is harmless.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

DEFAULT_SEGMENT_BYTES = 64 * 1024 * 1024
"""64 MiB per segment (~100k records of ~600 bytes): shipped segments are deleted whole."""
DEFAULT_APPEND_DEADLINE_S = 5.0
"""An fdatasync takes milliseconds on a healthy volume (tens on a busy network disk); 5 s is a
disk that has stopped, and the request fails clearly instead of waiting on it."""
OPEN_TAG = "kvgate-open"
_SEGMENT = re.compile(r"^wal-(\d{8})\.jsonl$")
LAYOUT = 2
"""The layout this code writes (see the module docstring)."""
KNOWN_LAYOUTS = (1, 2)
HEADER_TAG = "kvgate-wal"
SEAL_TAG = "kvgate-seal"
_SEAL_LINE_MAX = 256
"""A seal line is ~50 bytes; a longer second line is not one."""


class WalLocked(RuntimeError):
    """Another process owns this WAL directory."""


LEASE_FILE = "LEASE"


def lease_age_s(directory: Path, now: float | None = None) -> float | None:
    """How long ago the directory's owner last renewed its lease; None without a lease (a
    directory written before leases, or never opened)."""
    try:
        renewed = float((directory / LEASE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return (time.time() if now is None else now) - renewed


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


def seal_line(previous: str, good_size: int) -> bytes:
    return orjson.dumps([SEAL_TAG, previous, good_size]) + b"\n"


def seal_of(path: Path) -> tuple[str, int] | None:
    """The seal at a segment's head: (the previous segment's name, its good size), if any."""
    try:
        with open(path, "rb") as f:
            f.readline(_SEAL_LINE_MAX)  # the header
            line = f.readline(_SEAL_LINE_MAX)
    except FileNotFoundError:
        return None
    if not line.endswith(b"\n"):
        return None
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if (
        isinstance(value, list)
        and len(value) == 3
        and value[0] == SEAL_TAG
        and isinstance(value[1], str)
        and isinstance(value[2], int)
    ):
        return value[1], value[2]
    return None


def sealed_size(path: Path, following: Path | None) -> int | None:
    """How far a finished segment is read: the seal `following` (the next segment) gives it,
    else None (to its last complete line)."""
    if following is None:
        return None
    seal = seal_of(following)
    return seal[1] if seal is not None and seal[0] == path.name else None


def open_line(record_id: str, record: dict[str, Any]) -> bytes:
    return orjson.dumps([OPEN_TAG, record_id, record]) + b"\n"


class WalUnavailable(OSError):
    """A record could not be made durable: its write failed, or missed its deadline."""


def segment_paths(directory: Path) -> list[Path]:
    """The directory's segments in write order."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _SEGMENT.match(p.name))]
    return [p for _, p in sorted(found)]


def _lines(data: bytes) -> Iterator[dict[str, Any] | list[Any]]:
    for line in data.split(b"\n"):
        if not line:
            continue
        try:
            value = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # a torn line from a crash (never acknowledged): skip it
        if isinstance(value, dict | list):
            yield value


def _check_layout(path: Path, data: bytes) -> None:
    layout = segment_layout(data[: data.find(b"\n")])
    if layout not in KNOWN_LAYOUTS:
        raise WalLayoutError(
            f"{path} has WAL layout {layout}; this gateway reads layouts "
            f"{', '.join(map(str, KNOWN_LAYOUTS))}: read it with the gateway that wrote it"
        )


def read_segment(
    path: Path, offset: int = 0, end: int | None = None
) -> tuple[list[dict[str, Any]], int, bool]:
    """Complete records from `offset` (up to `end`, when given): (records, offset after the last
    complete line, whether bytes follow that are not a complete line — a torn tail, or a write
    in progress). The log's own lines (the header, open entries) are skipped."""
    with open(path, "rb") as f:
        if offset:
            f.seek(offset)
        data = f.read() if end is None else f.read(max(end - offset, 0))
    stop = data.rfind(b"\n") + 1
    if offset == 0 and stop:
        _check_layout(path, data)
    records = [r for r in _lines(data[:stop]) if isinstance(r, dict)]
    return records, offset + stop, stop < len(data)


def _with_ends(paths: list[Path]) -> Iterator[tuple[Path, int | None]]:
    """Each segment with where it is read up to (its seal; None: to its last complete line)."""
    for i, path in enumerate(paths):
        yield path, sealed_size(path, paths[i + 1] if i + 1 < len(paths) else None)


def read_directory(directory: Path) -> Iterator[dict[str, Any]]:
    """Every acknowledged record in a directory's segments, in write order (duplicates
    included): each segment up to its seal."""
    for path, end in _with_ends(segment_paths(directory)):
        records, _, _ = read_segment(path, 0, end)
        yield from records


def unsettled(directory: Path) -> list[dict[str, Any]]:
    """The aborted records of the open entries no record settles (see the module docstring:
    the last two segments hold every one)."""
    opened: dict[str, dict[str, Any]] = {}
    settled: set[str] = set()
    for path, end in list(_with_ends(segment_paths(directory)))[-2:]:
        data = path.read_bytes()
        for line in _lines(data if end is None else data[:end]):
            if isinstance(line, list):
                if len(line) == 3 and line[0] == OPEN_TAG and isinstance(line[2], dict):
                    opened[str(line[1])] = line[2]
            elif "id" in line:
                settled.add(str(line["id"]))
    return [record for key, record in opened.items() if key not in settled]


@dataclass(eq=False, slots=True)
class _Line:
    data: bytes
    future: asyncio.Future[None]
    durable: bool
    """Acknowledged after the sync (a record), else after the write (an open entry)."""


class WriteAheadLog:
    """The fsync'd, group-committed, append-only log of one gateway (see the module docstring)."""

    def __init__(
        self,
        directory: Path,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        deadline_s: float = DEFAULT_APPEND_DEADLINE_S,
    ) -> None:
        if segment_bytes <= 0:
            raise ValueError("segment_bytes must be positive")
        if deadline_s <= 0:
            raise ValueError("deadline_s must be positive")
        self.directory = directory
        self.segment_bytes = segment_bytes
        self.deadline_s = deadline_s
        self._lock_fd: int | None = None
        self._fd: int | None = None
        self._size = 0
        self.synced: tuple[Path | None, int] = (None, 0)
        """(the current segment, how many of its bytes are on stable storage): what shippers
        read, as one value — the writer's thread replaces it whole, so a reader never pairs one
        segment with another's size (a drain mid-rotation then read the old segment only as far
        as the new one's header, and missed what had been acknowledged)."""
        self._pending: list[_Line] = []
        self._flusher: asyncio.Task[None] | None = None
        self._open: dict[str, bytes] = {}
        self._num_in_flight = 0
        self._carry = False
        """A cut may have removed open entries: the next write carries them all again."""
        self._broken: tuple[int, OSError] | None = None
        """(the good size, why): the segment could not be cut back, nor a new one opened."""
        self.num_syncs = 0
        self.num_records = 0
        self.num_failures = 0
        self.num_recovered = 0
        """Aborted records written at `open` for a previous run's unsettled exchanges."""

    # -- lifecycle -----------------------------------------------------------------------------
    def open(self, *, take_over_after_s: float | None = None) -> None:
        """Own the directory (its lock, then its lease), bill a previous run's unsettled open
        entries, start a fresh segment. `take_over_after_s`: the directory of another gateway,
        taken over only if its lease is at least that old (`WalLocked` otherwise)."""
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
        age = lease_age_s(self.directory)
        if take_over_after_s is not None and age is not None and age < take_over_after_s:
            os.close(lock_fd)  # the lock is free but the lease fresh: its owner may be alive
            raise WalLocked(f"the billing WAL directory {self.directory} has a fresh lease")
        self._lock_fd = lock_fd
        self.renew_lease()
        recovered = unsettled(self.directory)
        self._rotate(b"")
        if recovered:
            data = b"".join(orjson.dumps(r) + b"\n" for r in recovered)
            self._sync(self._write(data, b""), b"")
            self.num_recovered = len(recovered)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def renew_lease(self) -> None:
        """Write the lease: this owner is alive now (no fsync: a lease lost with the machine
        belongs to an owner that is gone)."""
        path = self.directory / LEASE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(repr(time.time()))
        os.replace(tmp, path)

    async def flushed(self) -> None:
        """Wait until every write submitted so far has landed or failed."""
        while self._flusher is not None and not self._flusher.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(self._flusher)

    async def aclose(self) -> None:
        await self.flushed()
        self.close()

    # -- the API ---------------------------------------------------------------------------------
    async def append(self, record: dict[str, Any]) -> None:
        """Write one record; return once it is on stable storage (`WalUnavailable` if not)."""
        await self._submit(orjson.dumps(record) + b"\n", durable=True)

    async def append_line(self, line: bytes) -> None:
        await self._submit(line, durable=True)

    async def open_entry(self, record_id: str, record: dict[str, Any]) -> None:
        """An exchange's first token: keep the record it is billed by if it never ends, until
        `settle`. Returns once the line is written (a process kill keeps it; the next sync
        makes it durable), so it costs the exchange no sync of its own."""
        line = open_line(record_id, record)
        self._open[record_id] = line
        await self._submit(line, durable=False)

    def settle(self, record_id: str) -> None:
        """The exchange's own record is durable: its open entry is done with."""
        self._open.pop(record_id, None)

    @property
    def current(self) -> Path | None:
        """The segment being written."""
        return self.synced[0]

    @property
    def num_open(self) -> int:
        return len(self._open)

    @property
    def num_in_flight(self) -> int:
        """Lines submitted whose write has neither landed nor failed yet."""
        return self._num_in_flight

    async def _submit(self, data: bytes, *, durable: bool) -> None:
        if self._fd is None:
            raise RuntimeError("the WAL is not open")
        line = _Line(data, asyncio.get_running_loop().create_future(), durable)
        self._pending.append(line)
        self._num_in_flight += 1
        line.future.add_done_callback(self._landed)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        # NOTE: not wait_for(shield(...)): on its timeout wait_for yields (cancelling the shield)
        # before raising, and a line landing in that turn was then reported unavailable although
        # it was durable (its exchange billed twice: the record, then the aborted one). `wait`
        # never cancels the line, and the check and the cancel below run in one step.
        await asyncio.wait((line.future,), timeout=self.deadline_s)
        if not line.future.done():
            line.future.cancel()  # abandoned: the flusher leaves it out, or cuts it back out
            self.num_failures += 1
            raise WalUnavailable(
                f"the billing log did not write a record within {self.deadline_s:g} s"
            )
        line.future.result()  # the write's failure, if it failed

    def _landed(self, _: asyncio.Future[None]) -> None:
        self._num_in_flight -= 1

    # -- the flusher (event loop) ----------------------------------------------------------------
    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            lines = [line for line in batch if not line.future.done()]
            if lines:
                await self._commit(lines)
            if self._size >= self.segment_bytes:
                with contextlib.suppress(OSError):  # full disk: stay, try again next time
                    await asyncio.to_thread(self._rotate, self._carried())

    async def _commit(self, lines: list[_Line]) -> None:
        """Write a batch, acknowledge the open entries, sync, acknowledge the records; whatever
        fails fails the batch's waiters and leaves nothing of it in the log."""
        data = b"".join(line.data for line in lines)
        try:
            start = await asyncio.to_thread(self._write, data, self._carried())
            for line in lines:
                if not line.durable and not line.future.done():
                    line.future.set_result(None)
            if any(line.durable for line in lines):
                await asyncio.to_thread(self._sync, start, self._carried(), publish=False)
                self.num_syncs += 1
                kept = lines
                # written after their waiters gave up (nobody was told): cut them out, again
                # if more give up meanwhile; only the rest is ever shown to shippers, in the
                # same step as its waiters are told
                while any(line.durable and line.future.cancelled() for line in kept):
                    kept = [line for line in kept if not line.future.cancelled()]
                    data = b"".join(line.data for line in kept)
                    await asyncio.to_thread(self._replace, start, data, self._carried())
                self.synced = (self.current, self._size)
        except OSError as exc:
            self.num_failures += 1
            failure = WalUnavailable(f"the billing log could not be written: {exc}")
            for line in lines:
                if not line.future.done():
                    line.future.set_exception(failure)
            return
        for line in lines:
            if not line.future.done():
                line.future.set_result(None)
                self.num_records += line.durable

    def _carried(self) -> bytes:
        return b"".join(self._open.values())

    # -- the file (a worker thread; `carried` is the open entries, read on the event loop) ---
    def _write(self, data: bytes, carried: bytes) -> int:
        """Append `data` to the current segment; returns where it starts. On any error the
        segment is cut back (`_cut`) and the error raised."""
        self._repair(carried)
        if self._carry and carried:
            data = carried + data
        fd = self._fd
        assert fd is not None
        start = self._size
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
        except OSError:
            self._cut(start, carried)
            raise
        self._size = start + len(data)
        self._carry = False
        return start

    def _sync(self, start: int, carried: bytes, *, publish: bool = True) -> None:
        fd = self._fd
        assert fd is not None
        try:
            os.fdatasync(fd)
        except OSError:
            self._cut(start, carried)
            raise
        if publish:
            self.synced = (self.current, self._size)

    def _replace(self, start: int, data: bytes, carried: bytes) -> None:
        """Cut the segment back to `start` and write `data` there instead (synced; shippers
        are told by the caller, which never showed them past `start`)."""
        fd = self._fd
        assert fd is not None
        try:
            os.ftruncate(fd, start)
        except OSError:
            # NOTE: raised straight from here, the given-up lines stayed in the segment and the
            # next sync published them: a record reported failed was shipped, and won its id
            # over the aborted record the meter wrote next (issue 45, item 2)
            self._cut(start, carried)
            raise
        self._size = start
        self._carry = True  # open entries may have been in what was cut
        if data:
            self._sync(self._write(data, carried), carried, publish=False)
        else:
            try:
                os.fdatasync(fd)
            except OSError:
                self._cut(start, carried)
                raise

    def _cut(self, good: int, carried: bytes) -> None:
        """Leave nothing of a failed write: cut the segment back to `good` bytes; failing that,
        move to a new segment (the torn bytes stay behind, never acknowledged); failing that
        too, the log is broken and every write tries again first (`_repair`)."""
        self._carry = True
        fd = self._fd
        assert fd is not None
        try:
            os.ftruncate(fd, good)
            os.fdatasync(fd)
            self._size = good
            self.synced = (self.current, good)
            self._broken = None
            return
        except OSError as exc:
            cut_failed = exc
        try:
            self._rotate(carried, good)  # its seal ends this segment at `good`
            self._broken = None
        except OSError:
            self._broken = (good, cut_failed)

    def _repair(self, carried: bytes) -> None:
        if self._broken is None:
            return
        good, _ = self._broken
        self._cut(good, carried)
        if self._broken is not None:
            raise self._broken[1]

    def _rotate(self, carried: bytes, good: int | None = None) -> None:
        """Open the next segment: its header (a segment always names its layout), the seal of
        the one it follows (its good size: `good`, else what the log holds as written), then
        the open entries (`carried`)."""
        existing = segment_paths(self.directory)
        number = int(_SEGMENT.match(existing[-1].name).group(1)) + 1 if existing else 1  # type: ignore[union-attr]
        path = self.directory / f"wal-{number:08d}.jsonl"
        previous = self.current
        head = header_line()
        if previous is not None:
            if good is None:
                good = self._broken[0] if self._broken is not None else self._size
            head += seal_line(previous.name, good)
        head += carried
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
        try:
            view = memoryview(head)
            while view:
                view = view[os.write(fd, view) :]
            os.fdatasync(fd)
            dir_fd = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)  # the new segment's name is durable too
            finally:
                os.close(dir_fd)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        old, self._fd = self._fd, fd
        self._size = len(head)
        self._carry = False
        # the old segment is sealed at its good size: nothing is left to cut (a cut retried
        # here cut the *new* segment to the old one's size, padding it with NULs that made the
        # next acknowledged record unreadable)
        self._broken = None
        self.synced = (path, len(head))
        if old is not None:
            os.close(old)
