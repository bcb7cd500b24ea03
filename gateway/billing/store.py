"""The shared ledger store and the shipper that fills it from each gateway's WAL.

Store: a standalone Redis with the append-only file on (`appendonly yes`, `appendfsync always`,
so a reply means the write is on disk). One script call per record, all keys under one hash
tag (a Cluster slot), idempotent on the record id:

    {kvgate-billing}:records          HASH  id → the record (JSON)      HSETNX: the first write wins
    {kvgate-billing}:t:<tenant>       ZSET  id scored by start (unix s)  the time index of exports
    {kvgate-billing}:tenants          SET   tenant names
    {kvgate-billing}:layout           HASH  version: the layout of everything under the tag
                                            (these keys, `shared`'s entries and objects)

Layouts (`LAYOUT`): 1 has no layout key (before layouts were versioned); 2 is 1 plus the key,
so gateways of both share one store. A gateway finding no key writes its own; one finding a
layout it does not know refuses to start (`BillingLayoutError`), and exports refuse to read.

Durability: a segment is deleted once its records are put, so a put must mean "on disk". At
start (`check_durability`) a store whose `appendonly` is not `yes` or whose `appendfsync` is
not `always` is refused (`BillingDurabilityError`, naming the setting) unless the operator
accepts it (`billing_redis_allow_unsafe_fsync`); on Redis >= 7.2 every put also ends with
`WAITAOF 1 0`, which returns once the writes are fsync'd to the local AOF, whatever
`appendfsync` says (a put it does not confirm raises, so nothing is deleted or passed).

Shipper: reads each WAL segment from its shipped offset, puts the complete records, advances
the offset, deletes segments that are shipped and no longer written. A Redis outage only
delays shipping (with backoff): requests wait for the local fsync, never for Redis.
Without a store, the WAL directories are the ledger (`LocalLedger`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, Protocol

import orjson
from redis.exceptions import RedisError, ResponseError

from gateway.billing.pricing.money import dec
from gateway.billing.wal import (
    WalLayoutError,
    WriteAheadLog,
    read_directory,
    read_segment,
    sealed_size,
    segment_paths,
)
from gateway.tasks import BackgroundTasks

log = logging.getLogger(__name__)

PREFIX = "{kvgate-billing}"
SHIP_INTERVAL_S = 0.2
"""Ship every 200 ms: exports lag requests by well under a second while Redis is up."""
SHIP_BATCH = 500
"""Records per pipeline: one round trip for ~300 KB."""
MAX_BACKOFF_S = 5.0
"""While Redis is down, retry at most every 5 s (the WAL holds everything meanwhile)."""
QUERY_CHUNK = 1000
LAYOUT = 2
KNOWN_LAYOUTS = (1, 2)
LAYOUT_KEY = f"{PREFIX}:layout"
WAITAOF_TIMEOUT_MS = 5000
"""A put waits at most 5 s for its fsync (everysec fsyncs within ~1-2 s): past it the store is
taken as failing, and the shipper retries with backoff (the WAL keeps everything)."""
WAITAOF_SINCE = (7, 2)
"""WAITAOF came with Redis 7.2."""


class BillingLayoutError(ValueError):
    """The ledger store holds a layout this code does not know."""


async def check_layout(client: Any, *, claim: bool) -> int:
    """The store's layout (1 when it has no layout key); with `claim`, a store without one is
    marked as this code's layout. Raises `BillingLayoutError` for a layout this code does not
    know, before anything is read or written."""
    if claim:
        await client.hsetnx(LAYOUT_KEY, "version", LAYOUT)
    raw = await client.hget(LAYOUT_KEY, "version")
    version = int(raw) if raw is not None else 1
    if version not in KNOWN_LAYOUTS:
        raise BillingLayoutError(
            f"the billing ledger store has layout {version}; this gateway knows layouts "
            f"{', '.join(map(str, KNOWN_LAYOUTS))}: upgrade it, or give it another store"
        )
    return version


class BillingDurabilityError(ValueError):
    """The ledger store does not make each write durable before it answers."""


class StoreNotDurable(OSError):
    """WAITAOF did not confirm a put within its timeout (the shipper retries)."""


def supports_waitaof(version: str) -> bool:
    """Whether a Redis of `version` ("7.2.4") has WAITAOF."""
    parts = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    return parts >= WAITAOF_SINCE


@dataclass(frozen=True, slots=True)
class Durability:
    """What `check_durability` found: the server's version and whether puts use WAITAOF."""

    version: str
    wait_aof: bool


async def _config(client: Any, name: str) -> str | None:
    """A CONFIG GET value, None when the server refuses CONFIG (a managed Redis may)."""
    try:
        found = await client.config_get(name)
    except ResponseError:
        return None
    value = found.get(name)
    return value.decode() if isinstance(value, bytes) else value


async def check_durability(client: Any, *, allow_unsafe: bool) -> Durability:
    """Check, before anything is shipped, that a reply from the store means "on disk": the
    append-only file on, and fsync'd before each reply (`appendfsync always`), or WAITAOF
    (Redis >= 7.2) to confirm each put. Raises `BillingDurabilityError` naming what is wrong,
    unless `allow_unsafe` (then it is logged, once)."""
    info = await client.info("server")
    version = str(info.get("redis_version", "0"))
    wait_aof = supports_waitaof(version)
    appendonly = await _config(client, "appendonly")
    appendfsync = await _config(client, "appendfsync")
    problem = None
    if appendonly is None or appendfsync is None:
        if not wait_aof:
            problem = (
                f"refuses CONFIG GET and is Redis {version} (no WAITAOF), so nothing confirms "
                "that its writes are on disk"
            )
    elif appendonly != "yes":
        problem = "runs appendonly no: a restart loses what was shipped (and deleted)"
    elif appendfsync != "always" and not wait_aof:
        problem = (
            f"runs appendfsync {appendfsync} and is Redis {version} (WAITAOF needs 7.2): a crash "
            "within a second of a ship loses records whose segments are already deleted"
        )
    if problem is None and appendonly == "yes" and appendfsync != "always":
        log.info(
            "billing: the ledger store runs appendfsync %s: each put waits on WAITAOF", appendfsync
        )
    if problem is not None:
        message = (
            f"the billing ledger store {problem}; run it with appendonly yes and appendfsync "
            "always (docs/billing.md#the-ledger-store), or set billing_redis_allow_unsafe_fsync: "
            "true to accept the loss"
        )
        if not allow_unsafe:
            raise BillingDurabilityError(message)
        log.warning("%s (accepted: billing_redis_allow_unsafe_fsync)", message)
        wait_aof = wait_aof and appendonly == "yes"
    return Durability(version, wait_aof)


_PUT = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
  redis.call('SADD', KEYS[3], ARGV[4])
  return 1
end
return 0
"""


class LedgerStore(Protocol):
    async def put(self, records: list[dict[str, Any]]) -> int:
        """Store records idempotently; returns how many were new."""
        ...

    async def query(
        self, tenant: str | None, start: Decimal | None, end: Decimal | None
    ) -> list[dict[str, Any]]:
        """Records of one tenant (or all) with start ∈ [start, end), each id once, in order."""
        ...


def in_window(record: dict[str, Any], start: Decimal | None, end: Decimal | None) -> bool:
    t = dec(record["start_unix"])
    return (start is None or t >= start) and (end is None or t < end)


def ordered(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Deduplicated by id (the first copy wins, as in the store) and sorted by (start, id)."""
    seen: dict[str, dict[str, Any]] = {}
    for record in records:
        seen.setdefault(str(record["id"]), record)
    return sorted(seen.values(), key=lambda r: (dec(r["start_unix"]), str(r["id"])))


class RedisLedgerStore:
    """`wait_aof`: each put ends with WAITAOF 1 0 (`check_durability` says when), and returns
    only once the local AOF holds its writes on disk."""

    def __init__(self, client: Any, *, wait_aof: bool = False) -> None:
        self.client = client
        self.wait_aof = wait_aof
        self._script = client.register_script(_PUT)

    async def put(self, records: list[dict[str, Any]]) -> int:
        new = 0
        for i in range(0, len(records), SHIP_BATCH):
            async with self.client.pipeline(transaction=False) as pipe:
                batch = records[i : i + SHIP_BATCH]
                for record in batch:
                    tenant = str(record["tenant"])
                    keys = [f"{PREFIX}:records", f"{PREFIX}:t:{tenant}", f"{PREFIX}:tenants"]
                    score = str(record["start_unix"])
                    args = [str(record["id"]), orjson.dumps(record), score, tenant]
                    await self._script(keys=keys, args=args, client=pipe)  # queued, not sent
                if self.wait_aof:
                    # in the same pipeline: WAITAOF confirms the writes of its own connection
                    pipe.execute_command("WAITAOF", 1, 0, WAITAOF_TIMEOUT_MS)
                results = await pipe.execute()
            if self.wait_aof:
                local, _replicas = results.pop()
                if int(local) < 1:
                    raise StoreNotDurable(
                        "the ledger store did not fsync the shipped records within "
                        f"{WAITAOF_TIMEOUT_MS} ms"
                    )
            new += sum(int(x) for x in results)
        return new

    async def tenants(self) -> list[str]:
        names = await self.client.smembers(f"{PREFIX}:tenants")
        return sorted(n.decode() if isinstance(n, bytes) else str(n) for n in names)

    async def query(
        self, tenant: str | None, start: Decimal | None, end: Decimal | None
    ) -> list[dict[str, Any]]:
        tenants = [tenant] if tenant is not None else await self.tenants()
        lo = "-inf" if start is None else str(start)
        hi = "+inf" if end is None else str(end)  # inclusive here; exact filter below
        out: list[dict[str, Any]] = []
        for name in tenants:
            ids = await self.client.zrangebyscore(f"{PREFIX}:t:{name}", lo, hi)
            for i in range(0, len(ids), QUERY_CHUNK):
                chunk = ids[i : i + QUERY_CHUNK]
                values = await self.client.hmget(f"{PREFIX}:records", chunk)
                out.extend(orjson.loads(v) for v in values if v is not None)
        # scores are floats: the exact Decimal start decides the window
        return ordered(r for r in out if in_window(r, start, end))


class LocalLedger:
    """The ledger read straight from WAL directories (no shared store configured)."""

    def __init__(self, directories: Iterable[Path]) -> None:
        self.directories = list(directories)

    async def put(self, records: list[dict[str, Any]]) -> int:
        raise RuntimeError("the local ledger is written through the WAL, not put()")

    async def query(
        self, tenant: str | None, start: Decimal | None, end: Decimal | None
    ) -> list[dict[str, Any]]:
        """Read in a thread: every segment of every directory is read and parsed, which must
        not stall the requests the event loop serves meanwhile."""
        return await asyncio.to_thread(self.query_sync, tenant, start, end)

    def query_sync(
        self, tenant: str | None, start: Decimal | None, end: Decimal | None
    ) -> list[dict[str, Any]]:
        records = (
            r
            for directory in self.directories
            for r in read_directory(directory)
            if (tenant is None or r.get("tenant") == tenant) and in_window(r, start, end)
        )
        return ordered(records)


class Shipper:
    """Moves WAL records to the store, at least once (the store makes it exactly once)."""

    def __init__(
        self, wal: WriteAheadLog, store: LedgerStore, interval_s: float = SHIP_INTERVAL_S
    ) -> None:
        self.wal = wal
        self.store = store
        self.interval_s = interval_s
        self.offsets: dict[str, int] = self._load_offsets()
        self.num_shipped = 0
        self.num_new = 0
        self.failures = 0
        self.refused: set[str] = set()
        """Segments of a WAL layout this code does not know (left where they are)."""
        self._tasks = BackgroundTasks("billing shipper")
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()

    @property
    def _offsets_path(self) -> Path:
        return self.wal.directory / "shipped.json"

    def _load_offsets(self) -> dict[str, int]:
        try:
            data = orjson.loads(self._offsets_path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return {}
        return {str(k): int(v) for k, v in data.items()} if isinstance(data, dict) else {}

    def _save_offsets(self) -> None:
        tmp = self._offsets_path.with_suffix(".tmp")
        tmp.write_bytes(orjson.dumps(self.offsets))
        os.replace(tmp, self._offsets_path)  # no fsync: a lost offset only re-ships

    async def ship_once(self) -> int:
        """Ship everything complete now; returns the records shipped. Raises on store errors
        (the offsets only move past what the store acknowledged)."""
        async with self._lock:
            return await self._ship()

    async def _ship(self) -> int:
        shipped = 0
        current, synced = self.wal.synced  # one value: the segment and its size agree
        paths = segment_paths(self.wal.directory)
        for i, path in enumerate(paths):
            following = paths[i + 1] if i + 1 < len(paths) else None
            if current is not None and path.name > current.name:
                break  # the writer is creating it (`current` moves once it is ready)
            # decided before reading: the writer moves `current` only after the old segment's
            # last bytes are synced and the new one's seal written, so a segment seen finished
            # here is read up to its seal (bytes past it were a failed write, never
            # acknowledged), or in full when it has none (a crashed run's last segment); the
            # current one only as far as it is synced (a failed write is cut back)
            finished = path != current
            offset = self.offsets.get(path.name, 0)
            end = sealed_size(path, following) if finished else synced
            try:
                records, new_offset, _ = await asyncio.to_thread(read_segment, path, offset, end)
            except WalLayoutError as exc:  # never shipped as garbage, never deleted
                if path.name not in self.refused:
                    self.refused.add(path.name)
                    log.error("billing: not shipping %s", exc)
                continue
            if records:
                self.num_new += await self.store.put(records)
                shipped += len(records)
            if new_offset != offset:
                self.offsets[path.name] = new_offset
                self._save_offsets()
            if finished:
                # its tail, if any, is a torn write from a crash that was never acknowledged
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                self.offsets.pop(path.name, None)
                self._save_offsets()
        self.num_shipped += shipped
        return shipped

    def wake(self) -> None:
        self._wake.set()

    async def _run(self) -> None:
        delay = self.interval_s
        while True:
            try:
                await self.ship_once()
                delay = self.interval_s
            except (RedisError, OSError, ConnectionError, TimeoutError) as exc:
                self.failures += 1
                if delay == self.interval_s:
                    log.warning("billing: shipping to the ledger store failed, will retry: %s", exc)
                delay = min(delay * 2, MAX_BACKOFF_S)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)

    def start(self) -> None:
        if not self._tasks:
            self._tasks.spawn(self._run(), name="billing-shipper")

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Ship what is in the WAL now (for an export that must include this gateway's latest
        records); raises TimeoutError or the store's error when it cannot."""
        async with asyncio.timeout(timeout_s):
            await self.ship_once()

    async def stop(self) -> None:
        await self._tasks.close()
        with contextlib.suppress(RedisError, OSError, ConnectionError, TimeoutError):
            await asyncio.wait_for(self.ship_once(), 2.0)


async def ship_directories(
    directories: Iterable[Path], redis_url: str, *, allow_unsafe: bool = False
) -> dict[Path, int]:
    """Ship WAL directories whose gateway is gone (`kvgate billing ship`): each is taken over
    as its gateway would on a restart — its lock first, so a directory a live gateway still
    writes is refused (`WalLocked`) — shipped in full, and released. Records the store already
    holds are skipped (ids), so shipping twice is harmless."""
    from cachemap.redis.client import open_redis

    paths = list(directories)
    for path in paths:
        if not (path / "LOCK").exists():
            raise ValueError(f"{path} is not a billing WAL directory (no LOCK file)")
    client = await open_redis(redis_url, cluster=False)
    shipped: dict[Path, int] = {}
    try:
        durability = await check_durability(client, allow_unsafe=allow_unsafe)
        await check_layout(client, claim=True)
        store = RedisLedgerStore(client, wait_aof=durability.wait_aof)
        for path in paths:
            wal = WriteAheadLog(path)
            wal.open()
            try:
                shipped[path] = await Shipper(wal, store).ship_once()
            finally:
                await wal.aclose()
    finally:
        await client.aclose()
    return shipped
