"""Eviction frontiers over the shared event index: `cache_pressure` with `kv_events_shared`
(issue 16, placement under cache pressure, for any number of gateways).

In process, a gateway keeps each domain's GPU blocks in eviction order (`cachemap.recency`)
from the events it ingests and the placements it makes. Shared, one gateway owns each domain's
events (`cachemap.redis.events`), so the order lives with the owner, and the others see it as
the owner publishes it:

    owner: BlockStored / BlockRemoved / a wipe ──▶ its DomainRecency (EventWriter, exact)
           every round: the other gateways' touches in ──▶ the same
                        the domains whose order moved ──▶ their frontier out (HSET)
    every gateway, every round: the frontiers whose version moved ──▶ in (HMGET)
    a placement on a domain: owned here ──▶ its recency, now; else ──▶ RPUSH to its owner

Key schema (`{...}`: the cluster hash tag; the frontier hashes beside the domains hash):

    kvg:{kvg-ev}:frontier     HASH  domain id -> the published frontier (`pack`): the epoch,
                                    the GPU blocks held, the domain's name, then its oldest
                                    `MAX_PUBLISHED_RUNS` runs as (blocks, last use in wall s)
    kvg:{kvg-ev}:frontier:v   HASH  domain id -> its version (a reader fetches only what moved)
    kvg:{kvg-ev}:frontier:touched  HASH  domain id -> 1: its touch list has something (an idle
                                    owner reads this one hash, not every list)
    kvg:{kvg-ev:<id>}:touch   LIST  placements the owner has not applied yet: each the own keys
                                    (16 bytes each) a placement matched there; trimmed to the
                                    newest `MAX_QUEUED_TOUCHES`

Invariants and limits:
- A published frontier counts only at the epoch the reader's lookups see for its domain: after
  a wipe, until the owner's next round publishes the empty order of the new epoch, the domain
  has no frontier (it ranks as `cache_aware` ranks it), never the wiped one.
- Freshness: a reader's view of a domain it does not own is up to ~0.7 s old (the owner
  publishes a moved order at most every `PUBLISH_EVERY_S`, then the reader's fetch, `ROUND_S`
  each); another gateway's placement reaches the owner's order a round after it is made.
  A domain owned here reads the writer's own order, as in process.
  A fetch reads the domains' epochs with the frontiers (the lookups read them too), so a
  gateway that has routed nothing yet knows which published frontiers are current.
- Runs past the published `MAX_PUBLISHED_RUNS` (the newest blocks) are not listed: like any
  producer's cut-off (`router.types.KvFrontier`), they count as not evictable.
- A new owner (a takeover, a restart) knows which blocks its domain holds (the map in Redis),
  not their order: it starts them as one run used at adoption.
- Wall clocks: a run's last use is the owner's `time.time()`, its idle time the reader's; pods'
  clocks a few ms apart move nothing at a half-life of seconds.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from redis.asyncio.cluster import RedisCluster

from cachemap.events import GPU
from cachemap.keys import BlockHash
from cachemap.recency import to_depth
from cachemap.redis.client import AnyRedis
from cachemap.redis.event_scripts import DOMAINS_KEY
from cachemap.redis.events import EventReader, EventWriter
from cachemap.redis.schema import replica_id, text

log = logging.getLogger(__name__)

FRONTIER_KEY = b"kvg:{kvg-ev}:frontier"
VERSIONS_KEY = b"kvg:{kvg-ev}:frontier:v"
TOUCHED_KEY = b"kvg:{kvg-ev}:frontier:touched"
KEY_BYTES = 16
ROUND_S = 0.1
"""Every gateway's round: the versions fetched, an owner's touches applied and its moved
orders published (`PUBLISH_EVERY_S`). Idle, one round trip."""
PUBLISH_EVERY_S = 0.5
"""A domain's order is published at most twice a second (a new epoch at once): under load
every engine step moves it, and a frontier half a second old misses little against runs
merged within 1 s and a half-life of 5 s — publishing every round cost an owner of 64 busy
domains ~8% of a core (docs/benchmarks-archive.md)."""
MAX_PUBLISHED_RUNS = 256
"""Runs published per domain (12 bytes each, ~3 kB): the oldest, which a placement evicts
first; a domain's runs merge within a second, so 256 cover minutes of its history."""
MAX_TOUCHES_PER_ROUND = 256
"""Touches an owner applies per domain per round (the rest wait for the next)."""
MAX_QUEUED_TOUCHES = 1024
"""A domain's touch list is trimmed to its newest 1,024: an owner away for a while finds only
the recent ones, and Redis holds at most ~1,024 placements' keys per domain."""
MAX_TOUCHING = 256
"""Touch writes in flight per gateway: beyond it a placement's touch is not sent."""

_HEADER = struct.Struct("<qIH")
_RUN_BYTES = 12
"""A run's count (uint32) and last use (float64), in the machine's byte order (x86 and ARM
servers alike are little-endian: the gateways of one fleet agree)."""


def touch_key(rid: str) -> bytes:
    return b"kvg:{kvg-ev:" + rid.encode() + b"}:touch"


@dataclass(frozen=True, slots=True)
class Published:
    """One domain's frontier as its owner published it."""

    epoch: int
    num_blocks: int
    name: str
    runs: tuple[tuple[int, float], ...]
    """(blocks, last use in wall seconds), next evicted first."""


def pack(epoch: int, num_blocks: int, name: str, runs: Sequence[tuple[int, float]]) -> bytes:
    """The header, the name, then the runs' block counts (uint32) and their last uses
    (float64), each as one array (no Python step per run)."""
    encoded = name.encode()
    counts, used = zip(*runs, strict=True) if runs else ((), ())
    return b"".join(
        [
            _HEADER.pack(epoch, num_blocks, len(encoded)),
            encoded,
            array("I", counts).tobytes(),
            array("d", used).tobytes(),
        ]
    )


def unpack(raw: bytes) -> Published:
    """A published frontier back (ValueError / struct.error on a malformed one)."""
    epoch, num_blocks, name_len = _HEADER.unpack_from(raw)
    start = _HEADER.size + name_len
    if len(raw) < start or (len(raw) - start) % _RUN_BYTES:
        raise ValueError(f"a published frontier of {len(raw)} bytes is malformed")
    name = raw[_HEADER.size : start].decode()
    split = start + (len(raw) - start) // _RUN_BYTES * 4
    counts, used = array("I"), array("d")
    counts.frombytes(raw[start:split])
    used.frombytes(raw[split:])
    return Published(epoch, num_blocks, name, tuple(zip(counts, used, strict=True)))


def split_keys(blob: bytes) -> list[BlockHash]:
    """A touch's keys back."""
    keys = [blob[i : i + KEY_BYTES] for i in range(0, len(blob) - KEY_BYTES + 1, KEY_BYTES)]
    return cast(list[BlockHash], keys)


class SharedFrontiers:
    """Every gateway's side, and the owner's duties (module docstring). The frontiers'
    source (`gateway.pipeline.frontier.RecencySource`): `num_blocks`, `eviction_runs` and
    `touch` per domain, from the owner's memory for a domain owned here, else as published."""

    def __init__(
        self,
        client: AnyRedis,
        events: EventReader,
        writer: EventWriter | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.events = events
        self.writer = writer
        self.clock = clock
        self.cluster = isinstance(client, RedisCluster)
        self._published: dict[str, Published] = {}
        """domain name -> its frontier as last fetched"""
        self._versions: dict[bytes, bytes] = {}
        self._touching: set[asyncio.Task[None]] = set()
        self._leftover: set[str] = set()
        """Owned domains whose touch list held more than a round takes."""
        self.publish_every_s = PUBLISH_EVERY_S
        self.rounds = 0
        self.published = 0
        """Frontiers this gateway published (as an owner)."""
        self.touches_sent = 0
        self.touches_applied = 0
        """Other gateways' placements applied to the domains owned here."""
        self.touch_failures = 0
        self.malformed = 0
        self.round_failures = 0

    # -- the frontiers' source ---------------------------------------------------------------
    def _current(self, domain: str) -> Published | None:
        published = self._published.get(domain)
        if published is None or self.events.epochs.get(replica_id(domain)) != published.epoch:
            return None
        return published

    def _owner_here(self, domain: str) -> EventWriter | None:
        """This gateway's writer when it owns `domain` (its order is then in memory)."""
        writer = self.writer
        return writer if writer is not None and writer.owns(domain) else None

    def live(self, domain: str) -> bool:
        """The domain has an order to read: owned here, or published at its current epoch."""
        return self._owner_here(domain) is not None or self._current(domain) is not None

    def num_blocks(self, domain: str, tier: int = GPU) -> int:
        if (writer := self._owner_here(domain)) is not None:
            return writer.num_blocks(domain, tier)
        published = self._current(domain)
        return published.num_blocks if published is not None and tier == GPU else 0

    def eviction_runs(
        self, domain: str, depth: int, now_s: float, exclude: Sequence[BlockHash] = ()
    ) -> tuple[tuple[int, float], ...]:
        """The domain's next evicted GPU blocks: its owner's exact order, but for `exclude`,
        when owned here; else the published runs, which are counts without their keys, so
        `exclude` (the request's own cached prefix) cannot be left out of them and is not."""
        if (writer := self._owner_here(domain)) is not None:
            return writer.eviction_runs(domain, depth, now_s, exclude)
        published = self._current(domain)
        return to_depth(published.runs, depth, now_s) if published is not None else ()

    def touch(self, domain: str, keys: Sequence[BlockHash], now_s: float) -> int:
        """A placement here on `domain` (`keys`: the blocks it matched there): applied now
        when owned here, else sent to the owner in the background (the request does not
        wait). Returns the blocks touched now."""
        if (writer := self._owner_here(domain)) is not None:
            return writer.touch(domain, keys, now_s)
        if not keys or not self.events.live(domain):
            return 0
        if len(self._touching) >= MAX_TOUCHING:
            self.touch_failures += 1
            return 0
        task = asyncio.get_running_loop().create_task(
            self._send_touch(replica_id(domain), b"".join(keys))
        )
        self._touching.add(task)
        task.add_done_callback(self._touching.discard)
        return 0

    async def _send_touch(self, rid: str, blob: bytes) -> None:
        """The touch, then its mark (in a cluster the two are in different slots: sent one
        after the other, so an owner that sees the mark finds the touch)."""
        key = touch_key(rid)
        try:
            pipe = self.client.pipeline() if self.cluster else self.client.pipeline(False)
            pipe.rpush(key, blob)
            pipe.ltrim(key, -MAX_QUEUED_TOUCHES, -1)
            if self.cluster:
                await pipe.execute()
                await self.client.hset(TOUCHED_KEY, rid, 1)
            else:
                pipe.hset(TOUCHED_KEY, rid, 1)
                await pipe.execute()
        except Exception as exc:  # Redis away: the owner sees this conversation as colder
            self.touch_failures += 1
            log.debug("frontier touch not sent: %r", exc)
            return
        self.touches_sent += 1

    # -- rounds ------------------------------------------------------------------------------
    async def round(self) -> None:
        """One round: the versions (and, as an owner, the touch marks) in one pipeline; as an
        owner, apply the touches sent and publish what moved; then fetch the frontiers of
        other owners whose version moved. Idle, that is one round trip."""
        writer = self.writer
        owned = {replica_id(d): d for d in writer.domains()} if writer is not None else {}
        pipe = self.client.pipeline() if self.cluster else self.client.pipeline(False)
        pipe.hgetall(VERSIONS_KEY)
        if owned:
            pipe.hgetall(TOUCHED_KEY)
        replies = await pipe.execute()
        if writer is not None:
            if owned:
                await self._apply_touches(writer, owned, replies[1])
            await self._publish(writer)
        await self._fetch(replies[0], owned)
        self.rounds += 1

    async def _apply_touches(
        self, writer: EventWriter, owned: dict[str, str], marks: dict[Any, Any]
    ) -> None:
        """The touches of the owned domains marked touched (or left over from last round):
        the marks go first, then the lists are read, so a touch sent meanwhile is either
        taken now or marked again."""
        rids = sorted({text(r) for r in marks} & owned.keys() | self._leftover)
        if not rids:
            return
        self._leftover = set()
        if marks:
            await self.client.hdel(TOUCHED_KEY, *marks)
        pipe = self.client.pipeline() if self.cluster else self.client.pipeline(False)
        for rid in rids:
            pipe.lpop(touch_key(rid), MAX_TOUCHES_PER_ROUND)
        results = await pipe.execute(raise_on_error=False)
        now = self.clock()
        for rid, blobs in zip(rids, results, strict=True):
            if not isinstance(blobs, list):
                continue
            if len(blobs) >= MAX_TOUCHES_PER_ROUND:
                self._leftover.add(rid)  # more are waiting: next round
            for blob in blobs:
                writer.touch(owned[rid], split_keys(bytes(blob)), now)
                self.touches_applied += 1

    async def _publish(self, writer: EventWriter) -> None:
        moved = writer.take_moved_frontiers(MAX_PUBLISHED_RUNS, self.clock(), self.publish_every_s)
        if not moved:
            return
        version = str(time.time_ns()).encode()
        blobs: dict[Any, Any] = {
            replica_id(d): pack(epoch, n, d, runs) for d, epoch, n, runs in moved
        }
        pipe = self.client.pipeline() if self.cluster else self.client.pipeline(False)
        pipe.hset(FRONTIER_KEY, mapping=blobs)
        pipe.hset(VERSIONS_KEY, mapping=dict.fromkeys(blobs, version))
        try:
            await pipe.execute()
        except Exception:
            writer.frontiers_moved(d for d, *_ in moved)  # published next round
            raise
        self.published += len(blobs)

    async def _fetch(self, versions: dict[Any, Any], owned: dict[str, str]) -> None:
        """The frontiers whose version moved, but those owned here (read from the writer),
        with the domains' epochs: a gateway that routed nothing yet learns them here."""
        changed = []
        for rid, version in versions.items():
            if self._versions.get(rid) != version:
                self._versions[rid] = version
                if text(rid) not in owned:
                    changed.append(rid)
        gone = {text(rid) for rid in self._versions.keys() - versions.keys()}
        if gone:  # (a flushed Redis)
            self._versions = {r: v for r, v in self._versions.items() if text(r) not in gone}
            self._published = {
                d: p for d, p in self._published.items() if replica_id(d) not in gone
            }
        if not changed:
            return
        pipe = self.client.pipeline() if self.cluster else self.client.pipeline(False)
        pipe.hgetall(DOMAINS_KEY)
        pipe.hmget(FRONTIER_KEY, changed)
        domains, blobs = await pipe.execute()
        self.events.take_epochs(domains)
        for raw in blobs:
            if raw is None:
                continue
            try:
                published = unpack(bytes(raw))
            except (ValueError, struct.error, UnicodeDecodeError):
                self.malformed += 1
                continue
            self._published[published.name] = published

    async def run(self, interval_s: float = ROUND_S) -> None:
        """Rounds until cancelled; a failed round is logged once and retried."""
        failing = False
        while True:
            try:
                await self.round()
            except Exception as exc:
                self.round_failures += 1
                if not failing:
                    log.warning("KV frontiers: a round against Redis failed (retried): %s", exc)
                failing = True
            else:
                if failing:
                    log.warning("KV frontiers: rounds against Redis again")
                failing = False
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        await asyncio.gather(*self._touching, return_exceptions=True)
