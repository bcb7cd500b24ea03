"""The directory as the gateway uses it: shared through Redis when configured, never a reason
for a client to see an error.

    lookup ──▶ Redis (one script call, deadline `redis_deadline_s`) ──ok──▶ shared overlap
                  │ timeout / error
                  ▼
               the local in-process directory ──▶ overlap, degraded=True (the director then
                                                   breaks ties by consistent hashing, so all
                                                   gateways still agree on new prefixes)

Records and drops go to the local directory at once and to Redis through a bounded background
queue, flushed in batches (one script call per chain, concurrently) with a longer deadline: they
are off the request path, and when Redis is away they are dropped and counted, never retried
forever. After `DEGRADE_AFTER` consecutive failed lookups the gateway stops asking Redis and a
background probe pings it every `PROBE_INTERVAL_S` until it answers; each change of state is
logged once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from cachemap.keys import BlockHash
from cachemap.memory import MemoryDirectory
from cachemap.rates import PrefixRate, PrefixRates
from cachemap.redis.directory import LAND_CHANNEL, RedisDirectory, stop_task

log = logging.getLogger(__name__)

DEGRADE_AFTER = 3
"""Consecutive failed lookups before the gateway stops trying Redis on the request path: one
slow reply on a busy machine is not an outage."""
PROBE_INTERVAL_S = 0.5
"""How often a degraded gateway pings Redis to come back."""
WRITE_QUEUE_LIMIT = 10_000
"""Pending records/drops kept while Redis is slow; the oldest go first beyond this."""
WRITE_BATCH = 256


_Write = tuple[str, str, Sequence[BlockHash], float, Callable[[], Awaitable[object]] | None]
"""A queued write: (op, replica, hashes, time, call) — op "record", "drop", "expire" or "call"."""


@dataclass
class Lookup:
    overlap: dict[str, int]
    """replica -> leading blocks held"""
    degraded: bool
    """True when Redis did not answer and this came from the local directory"""
    last_use: dict[str, float] = field(default_factory=dict)
    """replica -> last use of the deepest matched block (what reconciliation may expire)"""
    hot_key: BlockHash | None = None
    """The prefix this request matched (the deepest block any replica holds)..."""
    hot: PrefixRate | None = None
    """...and its request rate including this request, and how many replicas it spreads over."""
    writer_depth: int = 0
    writer: str | None = None
    """Another gateway's fan-out leader writing this request's blocks up to `writer_depth`: its
    marker, "pending|<id>|<replica>|<expected s>" or "ok|..." / "fail|..." once it ended."""


@dataclass
class DirectoryStats:
    lookups: int = 0
    shared_lookups: int = 0
    fallbacks: int = 0
    lookup_seconds: float = 0.0
    writes_dropped: int = 0
    degraded: bool = False
    state_changes: int = 0
    lookup_latencies: deque[float] = field(default_factory=lambda: deque(maxlen=4096))


def _lookup(detail: dict[str, tuple[int, float]], *, degraded: bool) -> Lookup:
    return Lookup(
        {r: d for r, (d, _) in detail.items()},
        degraded,
        {r: t for r, (_, t) in detail.items()},
    )


class RoutingDirectory:
    def __init__(
        self,
        local: MemoryDirectory,
        shared: RedisDirectory | None = None,
        *,
        deadline_s: float = 0.005,
        write_deadline_s: float = 0.5,
        rates: PrefixRates | None = None,
        track_writers: bool = False,
    ) -> None:
        self.local = local
        self.rates = rates
        self.track_writers = track_writers
        self.on_land: Callable[[str], None] | None = None
        """Called with every landing another gateway's (or this one's) leader announces."""
        self.shared = shared
        self.deadline_s = deadline_s
        self.write_deadline_s = write_deadline_s
        self.stats = DirectoryStats()
        self._failures = 0
        self._markers: dict[str, str] = {}
        self._writes: deque[_Write] = deque(maxlen=WRITE_QUEUE_LIMIT)
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False

    @property
    def degraded(self) -> bool:
        return self.stats.degraded

    async def start(self) -> None:
        if self.shared is None:
            return
        try:
            await asyncio.wait_for(self.shared.start(), self.write_deadline_s * 4)
        except Exception as exc:
            self._set_degraded(True, f"Redis unavailable at start: {exc}")
            self._tasks.append(asyncio.create_task(self._probe()))
        self._tasks.append(asyncio.create_task(self._flush_writes()))
        if self.track_writers:
            self._tasks.append(asyncio.create_task(self._watch_landings()))

    async def close(self) -> None:
        self._closing = True
        for task in self._tasks:
            await stop_task(task, 2 * PROBE_INTERVAL_S)
        if self.shared is not None:
            with contextlib.suppress(Exception):
                await self.shared.close()

    # -- the request path --------------------------------------------------------------------
    async def lookup(self, hashes: Sequence[BlockHash]) -> Lookup:
        self.stats.lookups += 1
        if not hashes:
            return Lookup({}, self.degraded)
        if self.shared is not None and not self.degraded:
            started = time.perf_counter()
            window = self.rates.window_s if self.rates is not None else 0.0
            try:
                full = await asyncio.wait_for(
                    self.shared.lookup_full(
                        hashes, rate_window_s=window, writers=self.track_writers
                    ),
                    self.deadline_s,
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._lookup_failed(exc)
            else:
                elapsed = time.perf_counter() - started
                self.stats.lookup_seconds += elapsed
                self.stats.lookup_latencies.append(elapsed)
                self.stats.shared_lookups += 1
                self._failures = 0
                lookup = _lookup(full.detail, degraded=False)
                if full.hot_depth:
                    lookup.hot_key = hashes[full.hot_depth - 1]
                    lookup.hot = PrefixRate(full.rate_per_min, full.k)
                lookup.writer_depth, lookup.writer = full.writer_depth, full.writer
                return lookup
        if self.shared is not None:
            self.stats.fallbacks += 1
        detail = await self.local.lookup_detail(hashes)
        return self._rated(_lookup(detail, degraded=self.shared is not None), hashes)

    def _rated(self, lookup: Lookup, hashes: Sequence[BlockHash]) -> Lookup:
        depth = max(lookup.overlap.values(), default=0)
        if self.rates is not None and depth > 0:
            lookup.hot_key = hashes[depth - 1]
            lookup.hot = self.rates.observe(lookup.hot_key)
        return lookup

    def set_k(self, prefix: BlockHash, k: int) -> None:
        if self.rates is not None:
            self.rates.set_k(prefix, k)
        shared = self.shared
        if shared is not None:
            self._enqueue_call(lambda: shared.set_k(prefix, k))

    # -- fan-out leaders across gateways ---------------------------------------------------------
    async def lead(self, blocks: Sequence[BlockHash], marker: str, ttl_s: float) -> bool:
        """Mark blocks as being written (on the request path, with the lookup's deadline)."""
        if self.shared is None or self.degraded or not blocks:
            return False
        try:
            await asyncio.wait_for(self.shared.lead(blocks, marker, ttl_s), self.deadline_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.debug("fan-out marker not set: %s", exc)
            return False
        return True

    def land(self, blocks: Sequence[BlockHash], marker: str, landed: str, ttl_s: float) -> None:
        shared = self.shared
        if shared is not None:
            self._enqueue_call(lambda: shared.land(blocks, marker, landed, ttl_s))

    async def read_marker(self, block: BlockHash) -> str | None:
        if self.shared is None:
            return None
        try:
            return await asyncio.wait_for(self.shared.read_marker(block), self.deadline_s)
        except asyncio.CancelledError:
            raise
        except Exception:
            return None

    async def _watch_landings(self) -> None:
        shared = self.shared
        assert shared is not None
        while not self._closing:
            try:
                pubsub = shared.client.pubsub()
                await pubsub.subscribe(LAND_CHANNEL)
                try:
                    while not self._closing:
                        message = await pubsub.get_message(
                            ignore_subscribe_messages=True, timeout=PROBE_INTERVAL_S
                        )
                        if message is not None and self.on_land is not None:
                            data = message["data"]
                            self.on_land(data.decode() if isinstance(data, bytes) else str(data))
                finally:
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: waiters time out; try again shortly
                log.debug("landing watcher: %s", exc)
                await asyncio.sleep(PROBE_INTERVAL_S)

    async def record(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        await self.local.record(replica, hashes)
        self._enqueue("record", replica, hashes)

    async def drop(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        await self.local.drop(replica, hashes)
        self._enqueue("drop", replica, hashes)

    async def expire(self, replica: str, before_s: float) -> None:
        await self.local.expire(replica, before_s)
        self._enqueue("expire", replica, (), before_s)

    async def forget(self, replica: str) -> None:
        await self.local.forget(replica)
        if self.shared is not None:
            try:
                await asyncio.wait_for(self.shared.forget(replica), self.write_deadline_s)
            except Exception as exc:
                log.warning("could not bump %s's epoch in Redis: %s", replica, exc)

    async def observe_start(self, replica: str, start_marker: str) -> bool:
        """A replica reported its start marker (first sight or a change); True when that is a
        restart, whose entries then stop matching. With Redis the marker is compared with what
        every gateway has seen, so one restart bumps the shared epoch once, and a gateway that
        starts after an engine restarted still notices."""
        previous = self._markers.get(replica)
        self._markers[replica] = start_marker
        if self.shared is None:
            if previous is not None and previous != start_marker:
                await self.local.forget(replica)
                return True
            return False
        try:
            bumped = await asyncio.wait_for(
                self.shared.restarted(replica, start_marker), self.write_deadline_s
            )
        except Exception as exc:
            log.warning("could not check %s's start marker in Redis: %s", replica, exc)
            return False
        if bumped:
            await self.local.forget(replica)
        return bumped

    def register(self, replicas: Sequence[str]) -> None:
        if self.shared is not None:
            self.shared.register(replicas)

    # -- failure handling --------------------------------------------------------------------
    def _lookup_failed(self, exc: BaseException) -> None:
        log.debug("shared lookup failed: %r", exc)
        self._failures += 1
        if self._failures >= DEGRADE_AFTER and not self.degraded:
            reason = (
                "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
            )
            self._set_degraded(True, f"{self._failures} lookups failed ({reason})")
            self._tasks.append(asyncio.create_task(self._probe()))

    def _set_degraded(self, degraded: bool, why: str) -> None:
        if degraded == self.stats.degraded:
            return
        self.stats.degraded = degraded
        self.stats.state_changes += 1
        if degraded:
            log.warning("shared directory degraded, routing locally: %s", why)
        else:
            log.warning("shared directory back: %s", why)

    async def _probe(self) -> None:
        assert self.shared is not None
        while self.degraded:
            await asyncio.sleep(PROBE_INTERVAL_S)
            try:
                await asyncio.wait_for(self.shared.client.ping(), self.write_deadline_s)
                await asyncio.wait_for(self.shared.refresh_generations(), self.write_deadline_s)
            except asyncio.CancelledError:
                raise
            except Exception:
                continue
            self._failures = 0
            pool = getattr(self.shared.client, "connection_pool", None)
            if pool is not None:  # connections from before the outage are dead: drop them
                await pool.disconnect()
            self._set_degraded(False, "Redis answers again")

    # -- background writes -------------------------------------------------------------------
    def _enqueue(
        self, op: str, replica: str, hashes: Sequence[BlockHash], at_s: float = 0.0
    ) -> None:
        if self.shared is None or (not hashes and op != "expire"):
            return
        self._push((op, replica, hashes, at_s, None))

    def _enqueue_call(self, call: Callable[[], Awaitable[object]]) -> None:
        if self.shared is not None:
            self._push(("call", "", (), 0.0, call))

    def _push(self, item: _Write) -> None:
        if len(self._writes) == self._writes.maxlen:
            self.stats.writes_dropped += 1
        self._writes.append(item)
        self._idle.clear()
        self._wakeup.set()

    async def _flush_writes(self) -> None:
        assert self.shared is not None
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._writes:
                batch = [self._writes.popleft() for _ in range(min(WRITE_BATCH, len(self._writes)))]
                if self.degraded:
                    self.stats.writes_dropped += len(batch)
                    continue
                try:
                    await asyncio.wait_for(self._write(batch), self.write_deadline_s)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    self.stats.writes_dropped += len(batch)
                    log.debug("shared directory write failed: %s", exc)
            self._idle.set()

    async def _write(self, batch: list[_Write]) -> None:
        """Records first (one script call per chain, concurrently), then the rest."""
        shared = self.shared
        assert shared is not None
        records = [(r, h) for op, r, h, _, _ in batch if op == "record"]
        if records:
            await shared.record_many(records)
        await asyncio.gather(
            *(shared.drop(r, h) for op, r, h, _, _ in batch if op == "drop"),
            *(shared.expire(r, t) for op, r, _, t, _ in batch if op == "expire"),
            *(call() for op, _, _, _, call in batch if op == "call" and call is not None),
        )

    async def flushed(self) -> None:
        """Wait until every queued write has been attempted."""
        await self._idle.wait()

    @property
    def idle(self) -> bool:
        """No write is queued or in flight."""
        return self._idle.is_set()
