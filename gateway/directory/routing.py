"""The directory as the gateway uses it: shared through Redis when configured, never a reason
for a client to see an error.

    lookup ──▶ Redis (one script call, deadline `deadline.LookupDeadline`*) ──ok──▶ shared overlap
                  │ timeout / error (counted by the breaker)
                  ▼
               the local in-process directory ──▶ overlap, degraded=True (the director then
                                                   breaks ties by consistent hashing, so all
                                                   gateways still agree on new prefixes)

* from the lookup's write to its reply's receipt, on one Redis or each master of a cluster
  (`cachemap.redis.lookups`, `cachemap.redis.node_lanes`): a reply in the socket while this
  loop runs other requests is not a Redis that stopped answering. The deadline follows
  Redis's recent p99 round trip within a cap (`deadline`).

A shared lookup that matched nothing, or any while a write-back runs, also consults the local
index (what this gateway placed itself): Redis that lost entries — restarted empty, or missed
an outage's writes — costs the conversations this gateway placed nothing. A local entry Redis
had dropped for a reason (another gateway's reconciliation) costs one wrong prediction, which
this gateway's reconciliation then corrects in both stores.

The parts, one job each:
- `breaker.Breaker`: when Redis is treated as away, and the probe that brings it back;
- `deadline.LookupDeadline`: how long a lookup may take;
- `writes.WriteBehind`: records, drops, expiries and other writes, off the request path;
- `landings.LandingWatcher`: other gateways' fan-out leaders landing (pub/sub);
- `epochs.RestartEpochs`: restarted replicas' entries stop matching at once;
- `restore.WriteBack`: the local index written back when Redis lost entries (came back empty,
  or missed an outage's writes);
- this module: the facade the pipeline calls, and the fan-out markers (set on the request path
  with the lookup's deadline, read back while a sibling waits; both down the lookups' lane,
  so their deadline is Redis's time too).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cachemap.affinity import MAX_WALK_BLOCKS, Home
from cachemap.directory import Held, on_ms
from cachemap.keys import BlockHash
from cachemap.memory import MemoryDirectory
from cachemap.rates import PrefixRate, PrefixRates
from cachemap.redis import scripts
from cachemap.redis.directory import RedisDirectory
from cachemap.redis.meta import DirectoryLayoutError
from gateway.deadline import LookupDeadline
from gateway.directory.breaker import PROBE_LOOKUPS, Breaker
from gateway.directory.epochs import RestartEpochs
from gateway.directory.landings import POLL_UNSUBSCRIBED_S, READ_INTERVAL_S, LandingWatcher
from gateway.directory.restore import WriteBack
from gateway.directory.siblings import Siblings
from gateway.directory.writes import (
    Drop,
    Expire,
    Place,
    Record,
    Scripted,
    Write,
    WriteBehind,
)
from gateway.tasks import BackgroundTasks

log = logging.getLogger(__name__)

START_DEADLINE_FACTOR = 4
"""Redis's first answer (loading scripts, generations) may take this many write deadlines."""
DEFAULT_DEADLINE_CAP_S = 0.025
"""See `gateway.settings.DEFAULT_REDIS_DEADLINE_CAP_S`."""


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
    marker as stored (`gateway.pipeline.flights.Marker`)."""
    writer_from: int = 0
    """Where that leader's flight starts in this request's blocks: its marker is read there."""
    home: Home | None = None
    home_answered: bool = False
    """Redis answered for the conversation's home in this lookup's round trip (`lookup_homes`):
    `home` is its answer (None: Redis has none), and no `home()` call is needed."""
    held: dict[str, Held] = field(default_factory=dict)
    """replica -> what Redis holds of it from the first block (`SharedLookup.held`): its
    record leaves the fresh part as it is. Empty when Redis did not answer."""


@dataclass
class DirectoryStats:
    lookups: int = 0
    shared_lookups: int = 0
    fallbacks: int = 0
    local_hints: int = 0
    """Shared lookups the local index deepened (a miss in Redis, or during a write-back)."""
    home_round_trips: int = 0
    """Conversation homes asked of Redis in a call of their own (`home`), not in the lookup's
    round trip (`lookup_homes`): after a lookup Redis did not answer."""
    marker_failures: int = 0
    """Fan-out marker calls (`lead`, `read_marker`) Redis did not answer within the deadline
    (or failed): the deadline is Redis's time, down the lookups' lane."""
    home_failures: int = 0
    """`home` calls Redis did not answer within the deadline (or failed)."""
    lookup_seconds: float = 0.0
    lookup_latencies: deque[float] = field(default_factory=lambda: deque(maxlen=4096))


def _lookup(detail: dict[str, tuple[int, float]], *, degraded: bool) -> Lookup:
    """A match with no last use (0: a placement in flight, `place`) has nothing reconciliation
    could expire."""
    return Lookup(
        {r: d for r, (d, _) in detail.items()},
        degraded,
        {r: t for r, (_, t) in detail.items() if t > 0},
    )


class RoutingDirectory:
    def __init__(
        self,
        local: MemoryDirectory,
        shared: RedisDirectory | None = None,
        *,
        deadline_s: float = 0.005,
        deadline_per_block_s: float = 0.0,
        deadline_cap_s: float = DEFAULT_DEADLINE_CAP_S,
        write_deadline_s: float = 0.5,
        rates: PrefixRates | None = None,
        track_writers: bool = False,
        place_in_flight: bool = True,
    ) -> None:
        self.local = local
        self.rates = rates
        self.track_writers = track_writers
        self.place_in_flight = place_in_flight
        self.lookup_homes = False
        """Lookups also read the conversation's home (`Lookup.home`): set where affinity is
        weighed (`gateway.pipeline.keying`), one round trip for both."""
        """Placements reach Redis at routing time, not only at their first token (`place`)."""
        self.on_land: Callable[[str], None] | None = None
        """Called with every landing another gateway's (or this one's) leader announces."""
        self.deadline = LookupDeadline(deadline_s, deadline_per_block_s, deadline_cap_s)
        self.write_deadline_s = write_deadline_s
        self.stats = DirectoryStats()
        self._tasks = BackgroundTasks("directory")
        self.breaker = Breaker(self._probe, self._tasks)
        self.writes = WriteBehind(write_deadline_s, lambda: self.breaker.degraded)
        self.epochs = RestartEpochs(local, write_deadline_s)
        self.write_back = WriteBack(local.index, self._tasks)
        self.breaker.on_back = self._back
        self._shared: RedisDirectory | None = None
        self.shared = shared
        self._closing = False
        self._landings: LandingWatcher | None = None
        self.siblings: Siblings | None = None
        """The other workers of this pod (`--workers N`): what each places reaches every
        local index (`siblings`), so a fallback sees the pod's placements."""

    @property
    def shared(self) -> RedisDirectory | None:
        return self._shared

    @shared.setter
    def shared(self, shared: RedisDirectory | None) -> None:
        if shared is not None and shared.clock is not self.local.index.clock:
            # reconciliation applies a shared lookup's last use to the local index too
            raise ValueError(
                "the local and the shared directory must keep time on one clock "
                "(cachemap.directory.DIRECTORY_CLOCK)"
            )
        self._shared = shared
        self.epochs.shared = shared
        if shared is not None:
            for replica, capacity in self.local.index.capacities().items():
                shared.set_capacity(replica, capacity)  # engines scraped before it was attached
            shared.on_reset = self._reset
            shared.on_epoch = self._restarted_elsewhere
            shared.lane.on_round_trip = self.deadline.observe

    @property
    def degraded(self) -> bool:
        return self.breaker.degraded

    @property
    def idle(self) -> bool:
        """No write is queued or in flight, and no write-back runs."""
        return self.writes.idle and not self.write_back.running

    async def flushed(self) -> None:
        """Wait until Redis holds what this gateway knows: every queued write attempted and
        no write-back running."""
        await self.writes.flushed()
        await self.write_back.finished()

    async def start(self) -> None:
        if self.siblings is not None:
            self.siblings.start(self.local.index)
        shared = self.shared
        if shared is None:
            return
        try:
            await asyncio.wait_for(shared.start(), self.write_deadline_s * START_DEADLINE_FACTOR)
        except DirectoryLayoutError as exc:
            log.error("kvgate: %s", exc)  # a layout this gateway does not know: refuse to start
            raise
        except Exception as exc:
            self.breaker.degrade(f"Redis unavailable at start: {exc}")
        self._tasks.spawn(self.writes.run(shared), name="directory writes")
        if self.track_writers:
            self._landings = LandingWatcher(shared, self._landed, lambda: self._closing)
            self._tasks.spawn(self._landings.run(), name="landings")

    async def close(self) -> None:
        self._closing = True
        if self.siblings is not None:
            self.siblings.close()
        if self.shared is not None and not self.degraded:  # leave Redis what we know
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.flushed(), self.write_deadline_s)
        await self._tasks.close(2 * READ_INTERVAL_S)
        if self.shared is not None:
            with contextlib.suppress(Exception):
                await self.shared.close()

    async def _probe(self, reconnect: bool) -> None:
        """The breaker's probe: with `reconnect`, connections from before the outage are
        dropped first (they may be dead); the generations are made current, then real lookups
        (`PROBE_LOOKUPS`, of chains nobody holds: random 16-byte blocks, so a cluster's probes
        reach every master) must be answered within the lookup's deadline. The drop comes
        first: a refresh that finds Redis empty starts the write-back at once, and a drop after
        it closed the write-back's first connection under it (redis-py retried after a
        backoff)."""
        shared = self.shared
        assert shared is not None
        if reconnect:
            pool = getattr(shared.client, "connection_pool", None)
            if pool is not None:
                await pool.disconnect()
            await shared.lane.disconnect()
        await asyncio.wait_for(shared.refresh_generations(), self.write_deadline_s)
        deadline_s = self.lookup_deadline_s(1)
        await asyncio.gather(
            *(
                shared.lookup_full([BlockHash(os.urandom(16))], deadline_s=deadline_s)
                for _ in range(PROBE_LOOKUPS)
            )
        )

    def _restarted_elsewhere(self, replica: str) -> None:
        """Redis shows the replica restarted (its epoch moved; often another gateway saw it):
        its local entries go too, or a shared miss would be answered from them (`_hint`) with
        the past life's blocks (issue 45, item 17)."""
        self.local.index.forget(replica)

    def _reset(self) -> None:
        """Redis lost its state (the meta state is written back already): write back every
        local entry."""
        if self.shared is not None:
            self.write_back.start(self.shared, None, "Redis lost its state")

    def _back(self, since_s: float) -> None:
        """The outage that began at `since_s` is over: write back what Redis missed."""
        if self.shared is not None:
            since = since_s - self.write_deadline_s  # the writes failing before the breaker
            self.write_back.start(self.shared, since, "after an outage")

    def _landed(self, landed: str) -> None:
        if self.on_land is not None:
            self.on_land(landed)

    # -- the request path --------------------------------------------------------------------
    @property
    def deadline_s(self) -> float:
        """The lookup deadline's base (`LookupDeadline`)."""
        return self.deadline.base_s

    @deadline_s.setter
    def deadline_s(self, seconds: float) -> None:
        self.deadline.base_s = seconds

    def lookup_deadline_s(self, num_blocks: int) -> float:
        return self.deadline.seconds(num_blocks)

    async def lookup(self, hashes: Sequence[BlockHash]) -> Lookup:
        self.stats.lookups += 1
        if not hashes:
            return Lookup({}, self.degraded)
        shared = self.shared
        if shared is not None and shared.layout_error is not None and not self.degraded:
            self.breaker.degrade(str(shared.layout_error))
        if shared is not None and not self.degraded:
            started = time.perf_counter()
            window = self.rates.window_s if self.rates is not None else 0.0
            try:
                full = await shared.lookup_full(
                    hashes,
                    rate_window_s=window,
                    writers=self.track_writers,
                    # Redis's time, not this loop's lag; a long chain's walk takes longer
                    deadline_s=self.lookup_deadline_s(len(hashes)),
                    homes=MAX_WALK_BLOCKS if self.lookup_homes else 0,
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.breaker.failed(exc, started)
            else:
                elapsed = time.perf_counter() - started
                self.stats.lookup_seconds += elapsed
                self.stats.lookup_latencies.append(elapsed)
                self.stats.shared_lookups += 1
                self.breaker.succeeded()
                lookup = _lookup(full.detail, degraded=False)
                lookup.held = full.held
                if full.hot_depth:
                    lookup.hot_key = hashes[full.hot_depth - 1]
                    lookup.hot = PrefixRate(full.rate_per_min, full.k)
                lookup.writer_depth, lookup.writer = full.writer_depth, full.writer
                lookup.writer_from = full.writer_from
                if self.lookup_homes:
                    lookup.home_answered = True
                    if full.home is not None:
                        depth, replica = full.home
                        if 0 < depth <= len(hashes):
                            lookup.home = Home(replica, depth, hashes[depth - 1])
                if not lookup.overlap or self.write_back.running:
                    self._hint(lookup, await self.local.lookup_detail(hashes))
                return lookup
        if shared is not None:
            self.stats.fallbacks += 1
        detail = await self.local.lookup_detail(hashes)
        return self.rated(_lookup(detail, degraded=shared is not None), hashes)

    def _hint(self, lookup: Lookup, local: dict[str, tuple[int, float]]) -> None:
        """Deepen a shared lookup with what the local index holds."""
        hinted = False
        for replica, (depth, used) in local.items():
            if depth > lookup.overlap.get(replica, 0):
                lookup.overlap[replica] = depth
                lookup.last_use[replica] = used
                hinted = True
        if hinted:
            self.stats.local_hints += 1

    def rated(self, lookup: Lookup, hashes: Sequence[BlockHash]) -> Lookup:
        """`lookup` with its hot prefix, the deepest block matched, and that prefix's rate."""
        depth = max(lookup.overlap.values(), default=0)
        if self.rates is not None and depth > 0:
            lookup.hot_key = hashes[depth - 1]
            lookup.hot = self.rates.observe(lookup.hot_key)
        return lookup

    def uncount(self, prefix: BlockHash) -> None:
        """A later sibling of a fan-out flight: its lookup's count of `prefix` is taken back,
        in both stores (the siblings of one flight are one arrival)."""
        if self.rates is not None:
            self.rates.unobserve(prefix)
        self._write(Scripted(lambda shared: shared.hot.uncount_command(prefix)))

    def set_k(self, prefix: BlockHash, k: int) -> None:
        if self.rates is not None:
            self.rates.set_k(prefix, k)
        self._write(Scripted(lambda shared: shared.hot.set_k_command(prefix, k)))

    # -- what the engines hold ---------------------------------------------------------------
    async def record(
        self, replica: str, hashes: Sequence[BlockHash], held: Held | None = None
    ) -> None:
        """Both stores record the same instant (at the shared store's resolution), so an
        expiry at a last use either store returns means the same entries in both. `held`:
        what the request's lookup read Redis to hold of `replica` (`Lookup.held`): Redis's
        record leaves its fresh part as it is (`RedisDirectory.record_many`)."""
        at_s = on_ms(self.local.index.clock())
        self.local.index.record(replica, hashes, at_s)
        if hashes:
            if self.shared is not None:  # a frozen dataclass built for nothing without Redis
                self._write(Record(replica, hashes, at_s, held))
            if self.siblings is not None:
                self.siblings.record(replica, hashes, at_s)

    def place(self, replica: str, hashes: Sequence[BlockHash], held: int) -> None:
        """The request of `hashes` was placed on `replica`, which holds their first `held`:
        the rest reach Redis now as a placement in flight (`RedisDirectory.place`; write-behind,
        pushed at routing time), so every gateway's lookup sees where it went before its first
        token's record lands. Nothing without Redis: one gateway's own requests see their
        flights (`gateway.pipeline.flights`)."""
        if self.shared is not None and held < len(hashes) and self.place_in_flight:
            self._write(Place(replica, hashes[held:]))

    async def drop(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        await self.local.drop(replica, hashes)
        if hashes:
            self._write(Drop(replica, hashes))
            if self.siblings is not None:
                self.siblings.drop(replica, hashes)

    async def expire(
        self, replica: str, before_s: float, rewrite: Sequence[BlockHash] = ()
    ) -> None:
        """Entries of `replica` used at or before `before_s` stop matching (its floor).
        `rewrite`: a chain the engine holds now (the reconciled request's own), written whole
        to Redis after the floor at this instant: its record may have left its held blocks
        at the last use the floor is (`record`'s `held`)."""
        await self.local.expire(replica, before_s)
        self._write(Expire(replica, before_s))
        if rewrite:
            self._write(Record(replica, rewrite, on_ms(self.local.index.clock())))

    def _write(self, write: Write) -> None:
        if self.shared is not None:
            self.writes.push(write)

    async def forget(self, replica: str) -> None:
        await self.epochs.forget(replica)

    async def observe_start(self, replica: str, start_marker: str) -> bool:
        return await self.epochs.observe_start(replica, start_marker)

    def set_capacity(self, replica: str, engine_blocks: int | None) -> None:
        """The replica's engine holds `engine_blocks` directory entries' worth of KV (from its
        /metrics; None: it does not say): both stores keep at most the smaller of that and
        `directory_capacity_blocks` of its entries (`gateway.directory.sizing`)."""
        self.local.index.set_capacity(replica, engine_blocks)
        if self.shared is not None:
            self.shared.set_capacity(replica, engine_blocks)

    async def left(self, replica: str) -> None:
        """The replica left the fleet (discovery): its entries stop matching, and nothing this
        gateway kept about it stays."""
        await self.forget(replica)
        self.local.index.set_capacity(replica, None)
        self.epochs.left(replica)
        if self.shared is not None:
            self.shared.unregister(replica)

    def register(self, replicas: Sequence[str]) -> None:
        if self.shared is not None:
            self.shared.register(replicas)

    # -- fan-out leaders across gateways (`gateway.pipeline.flights.SharedMarkers`) ----------------
    async def lead(
        self, blocks: Sequence[BlockHash], marker: str, ttl_s: float, place_on: str | None = None
    ) -> bool:
        """Mark blocks as being written (on the request path, with the lookup's deadline).
        False only when no marker was sent. A call that failed or missed its deadline may have
        reached Redis all the same (the script was on the socket: Redis runs it when it gets
        to it), so it answers True and the leader lands what may be there — a marker left
        pending would hold every sibling that finds it until its hold's timeout.
        `place_on`: the request was placed there and `blocks` are what it does not hold —
        the placement in flight (`place`) goes in the marker's own call, not in a write-behind
        round trip of its own; a call that failed queues it the write-behind way too (the
        same field written twice). True then means the placement is dealt with."""
        shared = self.shared
        if shared is None or self.degraded or not blocks:
            return False
        place = shared.place_args(place_on) if place_on is not None and self.place_in_flight else ()
        try:  # down the lookups' lane: the deadline is Redis's time, not this loop's lag
            await shared.markers.lead(
                blocks, marker, ttl_s, deadline_s=self.lookup_deadline_s(len(blocks)), place=place
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.stats.marker_failures += 1
            log.debug("fan-out marker call failed (it may be set; the leader lands it): %s", exc)
            if place_on is not None:
                self.place(place_on, blocks, 0)
        return True

    # -- conversations' homes across gateways (`cachemap.affinity`, `Keying`) ----------------------
    async def home(self, hashes: Sequence[BlockHash]) -> tuple[bool, Home | None]:
        """(answered, the home Redis holds for `hashes`' conversation): one script call with the
        lookup's deadline; (False, None) without Redis, while degraded, or when it did not
        answer (the caller then reads its own table)."""
        shared = self.shared
        if shared is None or self.degraded or not hashes:
            return False, None
        self.stats.home_round_trips += 1
        try:
            found = await shared.homes.lookup(hashes, self.lookup_deadline_s(len(hashes)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.stats.home_failures += 1
            log.debug("conversation home lookup failed (the local table answers): %s", exc)
            return False, None
        return True, found

    def record_home(
        self, hashes: Sequence[BlockHash], replica: str, home: Home | None, ttl_s: float
    ) -> None:
        """The conversation of `hashes` went to `replica` (write-behind, off the request path)."""
        if self.shared is not None and hashes:
            self._write(
                Scripted(
                    lambda shared: (
                        shared.homes.record_command(hashes, replica, home, ttl_s),
                        scripts.SET_HOME,
                    )
                )
            )

    @property
    def landing_poll_s(self) -> float:
        """How often a sibling waiting for another gateway's leader re-reads its marker."""
        return self._landings.poll_s if self._landings is not None else POLL_UNSUBSCRIBED_S

    def land(self, blocks: Sequence[BlockHash], marker: str, landed: str, ttl_s: float) -> None:
        self._write(
            Scripted(
                lambda shared: (
                    shared.markers.land_command(blocks, marker, landed, ttl_s),
                    scripts.LAND,
                )
            )
        )

    async def read_marker(self, block: BlockHash) -> str | None:
        """The marker of the flight starting at `block`, "" when Redis has none, None when
        Redis did not answer."""
        if self.shared is None:
            return None
        try:
            marker = await self.shared.markers.read_marker(block, self.lookup_deadline_s(0))
            return "" if marker is None else marker
        except asyncio.CancelledError:
            raise
        except Exception:
            self.stats.marker_failures += 1
            return None
