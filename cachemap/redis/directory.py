"""The Redis directory: the same protocol as the in-process one, shared by every gateway.

The key schema is in `cachemap.redis.schema`, the scripts in `cachemap.redis.scripts`, the
per-replica state beside the entries (generations, floors, start markers, the layout) in
`cachemap.redis.meta`.

Generations do three jobs with one number per replica:
- An entry matches only if its generation is at least the replica's oldest live one.
- Capacity (its own: the smaller of the setting and its engine's KV, `set_capacity`): Redis
  counts a replica's entries at each live generation (a recorded, used, block is rewritten at
  the current generation: one more there, one less where it was); the generation advances after
  `blocks_per_generation(capacity)` (1/16 of it) are at it, and the oldest live generation is
  dropped while the entries left are nearer the capacity than with it: an LRU approximation
  within half a generation of the capacity (`DISTINCT_GENERATIONS`).
- Restart epochs: `forget()` (and a new engine start marker) advances it by 2, so every old
  entry stops matching at once: an epoch bump, never a scan. Stale fields die with their keys'
  TTL.
Gateways keep the current generations and floors in memory and pass them to the lookup script,
which also applies the TTL to each entry's last use, so an entry refreshed by one replica does
not keep another's alive. Two tasks keep them current, independently: the channel's subscriber
(within milliseconds) and a poll every `GEN_REFRESH_S` that never depends on the subscription
(a gateway whose pub/sub is broken — a proxy or an ACL that refuses SUBSCRIBE, a redis-py
without cluster pub/sub — is stale for at most that long, and says so once in its log). The
poll also notices a Redis that lost its state and writes back what the gateway knows
(`ReplicaMeta.refresh`), and now and then prunes replicas quiet for longer than the TTL.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError

from cachemap.directory import (
    DEFAULT_REPLICA_CAPACITY_BLOCKS,
    DEFAULT_TTL_S,
    DIRECTORY_CLOCK,
    Clock,
    Held,
    to_ms,
)
from cachemap.keys import TAG_BYTES, BlockHash
from cachemap.rates import MIN_SPAN_S
from cachemap.redis import scripts
from cachemap.redis.client import AnyRedis, close_pubsub, stop_task
from cachemap.redis.lookups import LookupLane
from cachemap.redis.meta import DirectoryLayoutError, ReplicaMeta
from cachemap.redis.node_lanes import NodeLanes
from cachemap.redis.schema import (
    BASE_KEY,
    CHANNEL,
    COUNT_KEY,
    GEN_KEY,
    LIVE_KEY,
    SEEN_KEY,
    chain_call,
    replica_id,
    text,
)
from cachemap.redis.stores import HomeStore, MarkerStore, RateStore

log = logging.getLogger(__name__)

GEN_REFRESH_S = 1.0
"""The poll behind the channel: a gateway that missed a message (or cannot subscribe) is stale
for at most 1 s, at the cost of two HGETALLs of small hashes per second per gateway."""
PRUNE_INTERVAL_S = 60.0
"""How often the poll prunes quiet replicas from the meta hashes: a scan of a few hundred
fields, idempotent whichever gateways run it."""
PRUNE_HORIZON_TTLS = 2.0
"""A replica is pruned after twice the entry TTL without a record or a restart report: none
of its entries can match by then, with a TTL's margin for clocks that disagree."""
RESTORE_BATCH = 512
"""Blocks per write-back call: ~0.5 ms of server time, so a write-back of a whole index never
holds Redis for long."""
DISTINCT_GENERATIONS = 16
"""A replica's capacity is counted in this many generations of distinct entries: its current
generation advances once capacity / 16 entries are at it (a block recorded again moves from its
generation to the current one), and its oldest live generation is dropped while the entries
left are nearer the capacity than with it (`scripts._COUNTED`), so what matches is the most
recently recorded distinct blocks, within half a generation of the capacity, as in the
in-process store (an exact LRU). Two generations of 3/4 (the rule before) held 0.75-1.5x of it:
`kvgate sim` read 96.2% / 97.8% of one gateway's hit ratio at two / four gateways, 98.95% /
99.01% with 16 distinct generations (docs/design/directory.md, "The generations' capacity in
distinct blocks")."""


def blocks_per_generation(capacity_blocks: int) -> int:
    """Entries at its current generation after which a replica of `capacity_blocks` advances."""
    return max(math.ceil(capacity_blocks / DISTINCT_GENERATIONS), 1)


PLACEMENT_TTL_S = 10.0
"""How long a placement in flight (`RedisDirectory.place`) extends its replica's match before its
first token's record replaces it: a loaded engine's prefill queue (the bench's TTFT p99 is
~3 s); a request that never reaches its first token (failed, moved, abandoned) misleads other
gateways' lookups for at most this long, as one prediction reconciliation does not expire."""
RECORD_CHUNK = 128
"""Blocks per `RECORD` call; a longer chain's record is several calls. In precise mode the
chain is the engine's 16-token blocks: an agent's 50k-115k-token prompt is 3,000-7,000 of them,
every turn rewrites them all (their last use), at ~4 µs of Redis a block (HGET, HSET,
PEXPIRE): one call held Redis 20 ms median and up to 0.38 s at two gateways on a loaded
machine, and the lookups queued behind it timed out (issue 39)."""
RECORD_REFRESH_S = 4.0
"""A record leaves a chain's leading blocks as Redis holds them (`Held`, from the request's
lookup) when every one of them is at the replica's current generation and was used less than
this long before the record — and less than 1/8 of the TTL and of the time since the replica's
floor (`refresh_ms`): a block's last use in Redis is then at most this much older than the
engine's, which neither the TTL nor a floor set by reconciliation resolves at that scale (see
docs/design/directory.md, "Records write what changed")."""


def record_refresh_ms(ttl_ms: int, since_floor_ms: int) -> int:
    """How recent (ms) a held block's last use must be for a record to leave it as it is:
    `RECORD_REFRESH_S`, at most 1/8 of the TTL and of the time since the replica's floor (a
    replica whose engine evicts within seconds has its every record written whole)."""
    return max(min(int(RECORD_REFRESH_S * 1000), ttl_ms // 8, since_floor_ms // 8), 0)


RECORD_ROUND_BLOCKS = 512
"""Blocks' records per pipeline, the pipelines one after another (`events.SPECULATE_ROUND`:
Redis runs a pipeline that arrived whole before it reads another client, and single calls
cost a round trip each)."""
MAX_PIPELINED_LOOKUPS = 8
"""Lookups per pipelined write: a burst is cut into several writes (in a cluster, several
pipelines on several connections), so the client reads one write's answers while Redis runs the
next one's scripts."""


_META = (GEN_KEY, COUNT_KEY, SEEN_KEY, BASE_KEY, LIVE_KEY)
"""The meta keys a record counts its new blocks in, on a single Redis (`RECORD_COUNTED`)."""


@dataclass
class _Queued:
    """A lookup waiting for its tick's batch to be written."""

    keys: list[bytes]
    args: list[Any]
    deadline_s: float | None
    future: asyncio.Future[Any]


@dataclass
class SharedLookup:
    detail: dict[str, tuple[int, float]]
    hot_depth: int = 0
    rate_per_min: float = 0.0
    k: int = 1
    writer_depth: int = 0
    writer: str | None = None
    writer_from: int = 0
    """The index of the writer's flight's first block in the looked-up chain (its marker's key)."""
    home: tuple[int, str] | None = None
    """With `homes`: (depth, replica) of the conversation's home (`HomeStore`), None: none."""
    held: dict[str, Held] = field(default_factory=dict)
    """replica -> its entries alone from the first block (what its record may leave as it is:
    `RedisDirectory.record_many`)."""


class RedisDirectory:
    """The `Directory` protocol on Redis or Redis Cluster (see the module docstring)."""

    def __init__(
        self,
        client: AnyRedis,
        *,
        capacity_blocks: int = DEFAULT_REPLICA_CAPACITY_BLOCKS,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Clock = DIRECTORY_CLOCK,
    ) -> None:
        if capacity_blocks < 2:
            raise ValueError(f"capacity_blocks must be at least 2, got {capacity_blocks}")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.client = client
        self.capacity_blocks = capacity_blocks
        self.ttl_s = ttl_s
        self.clock = clock
        self.cluster = isinstance(client, RedisCluster)
        self._lookup = client.register_script(scripts.LOOKUP)
        self.batch_lookups = True
        """Pipeline the lookups of one event-loop tick (else each is written as it comes);
        either way down the lookups' own connection (`cachemap.redis.lookups`, one per master
        of a cluster: `cachemap.redis.node_lanes`), the deadline on Redis's time, not the
        loop's lag."""
        self.lane: LookupLane | NodeLanes = (
            NodeLanes(client, scripts.LOOKUP, self._lookup.sha)
            if isinstance(client, RedisCluster)
            else LookupLane(client, scripts.LOOKUP, self._lookup.sha)
        )
        self._batch: list[_Queued] = []
        self._record = client.register_script(scripts.RECORD)
        self._record_counted = client.register_script(scripts.RECORD_COUNTED)
        self._counted_head = ("EVALSHA", self._record_counted.sha, 1 + len(_META))
        self._place = client.register_script(scripts.PLACE)
        self._restore = client.register_script(scripts.RESTORE)
        self._drop = client.register_script(scripts.DROP)
        self._writes = None if isinstance(client, RedisCluster) else LookupLane(client, "", "")
        """The write-behind's connection on a single Redis (`_pipelined`): a round of records,
        placements and landings in one write down a connection of its own, not a pooled
        pipeline (a connection taken and given back, the retry wrapper, the send's
        `wait_for`: ~0.6 ms of a busy gateway's CPU a round of flow control's counters).
        A Cluster keeps the pipeline (its masters' shares)."""
        self.hot = RateStore(client)
        self.markers = MarkerStore(client, self.lane)
        self.homes = HomeStore(client, self.lane)
        self.meta = ReplicaMeta(client)
        self.meta.on_change = self._meta_changed
        self.meta.on_epoch = self._epoch
        self.on_epoch: Callable[[str], None] | None = None
        """Called with a replica's name when Redis shows it restarted (its generation rose by
        a restart epoch: another gateway, or this one, reported it)."""
        self.on_reset: Callable[[], None] | None = None
        """Called when Redis is found to have lost its state (after the meta state is written
        back): the owner may write back its entries (`restore`)."""
        self.layout_error: DirectoryLayoutError | None = None
        """Set when Redis holds a layout this code does not know: the directory is unusable."""
        self._names: dict[str, str] = {}
        self._capacities: dict[str, int] = {}
        """Replica ids whose engine holds fewer blocks than `capacity_blocks` -> what it holds
        (`set_capacity`)."""
        self._replica_arg: bytes | None = None
        """The lookup's per-replica argument, cached (rebuilt when a generation, a floor or the
        set of replicas changes)."""
        self._last_prune = 0.0
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self.subscribed = False
        """The channel's subscription is up (else the poll alone keeps generations fresh)."""
        self._subscription_failed = False
        self.blocks_written = 0
        """Blocks the records sent to Redis (`record_many`)..."""
        self.blocks_kept = 0
        """...and the blocks they left as Redis held them (fresh: `_kept`)."""

    @property
    def lookup_sha(self) -> str:
        """The lookup script's SHA (what a lookup's EVALSHA names)."""
        return str(self._lookup.sha)

    # -- the protocol ------------------------------------------------------------------------
    async def lookup(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        return {r: d for r, (d, _) in (await self.lookup_detail(hashes)).items()}

    async def lookup_detail(self, hashes: Sequence[BlockHash]) -> dict[str, tuple[int, float]]:
        return (await self.lookup_full(hashes)).detail

    async def lookup_full(
        self,
        hashes: Sequence[BlockHash],
        *,
        rate_window_s: float = 0.0,
        writers: bool = False,
        deadline_s: float | None = None,
        homes: int = 0,
    ) -> SharedLookup:
        """One script call: each replica's depth and last use; with `rate_window_s`, the
        matched prefix's request rate (this request counted) and k; with `writers`, the
        deepest uncached block an in-flight leader is writing and the leader's marker; with
        `homes`, the conversation's home, looked for that many blocks back from the end (what
        `HomeStore.lookup` answers, in the same round trip).
        With `deadline_s`, a `TimeoutError` when Redis did not answer within it (on one Redis,
        the time to the reply's receipt: `cachemap.redis.lookups`)."""
        if not hashes:
            return SharedLookup({})
        if self._replica_arg is None:  # rebuilt only when a generation or a floor changed
            # only the replicas this gateway routes to (lookups report no other): bounded
            meta = self.meta
            self._replica_arg = "".join(
                f"{rid},{meta.oldest(rid)},{meta.floor(rid)};" for rid in self._names
            ).encode()
        args: list[Any] = [
            to_ms(self.clock()),
            int(self.ttl_s * 1000),
            int(rate_window_s * 1000),
            1 if writers else 0,
            self._replica_arg,
            int(MIN_SPAN_S * 1000),
            homes,
        ]
        keys, head = chain_call(hashes)
        flat, hot, writer, home, kept = await self._call_lookup(keys, [*head, *args], deadline_s)
        names = self._names
        detail: dict[str, tuple[int, float]] = {}
        for i in range(0, len(flat), 3):  # a last use of 0: matched by a placement in flight
            name = names.get(text(flat[i]))
            if name is not None:
                detail[name] = (int(flat[i + 1]), int(flat[i + 2]) / 1000)
        result = SharedLookup(detail)
        for i in range(0, len(kept), 4):
            name = names.get(text(kept[i]))
            if name is not None:
                result.held[name] = Held(int(kept[i + 1]), int(kept[i + 2]), int(kept[i + 3]))
        if hot:
            result.hot_depth, result.rate_per_min, result.k = (
                int(hot[0]),
                float(hot[1]),
                int(hot[2]),
            )
        if writer:
            result.writer_depth, result.writer = int(writer[0]), text(writer[1])
            result.writer_from = int(writer[2]) - 1
        if home:
            result.home = int(home[0]), text(home[1])
        return result

    async def _call_lookup(
        self, keys: list[bytes], args: list[Any], deadline_s: float | None
    ) -> Any:
        """One EVALSHA per lookup, down the lane (which keeps the deadline on Redis's time);
        the lookups that arrive in the same event-loop tick share one pipelined write (each
        still its own command and its own answer)."""
        queued = _Queued(keys, args, deadline_s, asyncio.get_running_loop().create_future())
        if not self.batch_lookups:
            self.lane.send([(keys, args, deadline_s, queued.future)])
            return await queued.future
        batch = self._batch
        batch.append(queued)
        if len(batch) == 1:
            asyncio.get_running_loop().call_soon(self._flush_lookups, batch)
        if len(batch) == MAX_PIPELINED_LOOKUPS:
            self._batch = []  # the next lookups start the next pipeline
        return await queued.future

    def _flush_lookups(self, batch: list[_Queued]) -> None:
        if batch is self._batch:
            self._batch = []
        live = [item for item in batch if not item.future.done()]  # callers may have given up
        if live:
            self.lane.send([(item.keys, item.args, item.deadline_s, item.future) for item in live])

    async def record(
        self, replica: str, hashes: Sequence[BlockHash], held: Held | None = None
    ) -> None:
        await self.record_many([(replica, hashes, None, held)])

    def refresh_ms(self, replica: str, used_ms: int) -> int:
        """`record_refresh_ms` for a record of `replica` at `used_ms`."""
        since_floor = used_ms - self.meta.floor(self._rid(replica))
        return record_refresh_ms(int(self.ttl_s * 1000), since_floor)

    def _kept(self, rid: str, gen: int, used_ms: int, held: Held | None, refresh_ms: int) -> int:
        """How many leading blocks of a record at `used_ms` stay as Redis holds them: the
        replica's entries its lookup read from the first block, when the oldest is at `gen` and
        used less than `refresh_ms` before (else the whole chain is written)."""
        if held is None or held.gen != gen or used_ms - held.used_ms >= refresh_ms:
            return 0
        return held.depth

    async def record_many(
        self,
        items: Iterable[tuple[str, Sequence[BlockHash], float | None, Held | None]],
        places: Iterable[tuple[str, Sequence[BlockHash]]] = (),
        scripted: Iterable[tuple[tuple[Any, ...], str]] = (),
    ) -> None:
        """Several records at once: one script call per chain (of at most `RECORD_CHUNK`
        blocks), which on a single Redis also counts its new blocks against the replica's
        generation (`RECORD_COUNTED`; a Cluster keeps the meta slot apart, so one count per
        replica follows there). Each item is (replica, chain, when it was used: None for now,
        what the request's lookup read the replica to hold: None if not known). A record
        writes from where the replica's held entries end when they are fresh (`_kept`: at
        the current generation, used within `refresh_ms`), else the whole chain. `places`:
        placements in flight (`place`) written after them; `scripted`: other script calls,
        (command, the script's source) — a landing (`MarkerStore.land_command`), a home
        (`HomeStore.record_command`). All go down one pipeline, in that order (one
        connection, one write, one read: `_pipelined`), not one pooled command each."""
        now_ms = to_ms(self.clock())
        calls, sizes = self._record_calls(items, now_ms)
        counted = not self.cluster  # the count in the record's own call (`RECORD_COUNTED`)
        source = scripts.RECORD_COUNTED if counted else scripts.RECORD
        rounds: list[tuple[list[tuple[Any, ...]], list[str]]] = [
            ([], []) for _ in range(calls[-1][0] + 1 if calls else 1)
        ]
        last = {rid: i for i, (_, rid, _) in enumerate(calls)}
        rids = []
        for i, (at, rid, call) in enumerate(calls):
            if counted:  # every call adds its new blocks to the count; a replica's last call
                # in the batch advances its generation, as one COUNT of the batch's sum did
                per_gen, capacity = sizes[rid]
                count = (per_gen if last[rid] == i else 0, CHANNEL, now_ms, capacity)
                command = (*self._counted_head, call[0], *_META, *call[1:], *count)
            else:
                command = ("EVALSHA", self._record.sha, 1, *call)
            rounds[at][0].append(command)
            rounds[at][1].append(source)
            rids.append(rid)
        commands, sources = rounds[-1]  # placements and the other scripts: with the last
        for replica, hashes in places:
            if hashes:
                commands.append(self._place_command(replica, hashes, PLACEMENT_TTL_S))
                sources.append(scripts.PLACE)
        for command, source in scripted:
            commands.append(command)
            sources.append(source)
        replies: list[Any] = []
        for round_commands, round_sources in rounds:
            if round_commands:
                replies += await self._pipelined(round_commands, round_sources)
        if counted:
            for rid, (_, gen, oldest) in zip(rids, replies, strict=False):
                self.meta.set_gen(rid, int(gen))
                self.meta.set_live(rid, int(gen), int(oldest))
        else:
            await self._count(rids, calls, replies, sizes, now_ms)

    def _record_calls(
        self,
        items: Iterable[tuple[str, Sequence[BlockHash], float | None, Held | None]],
        now_ms: int,
    ) -> tuple[list[tuple[int, str, tuple[Any, ...]]], dict[str, tuple[int, int]]]:
        """`record_many`'s script calls, without the script: (the pipeline it goes in, the
        replica id, the chain's key and the arguments) for each chunk of at most
        `RECORD_CHUNK` blocks, the pipelines sent one after another, each of at most
        `RECORD_ROUND_BLOCKS` blocks' records; and each replica's (blocks per generation,
        capacity): `_sizes`."""
        ttl_ms = int(self.ttl_s * 1000)
        calls: list[tuple[int, str, tuple[Any, ...]]] = []
        sizes: dict[str, tuple[int, int]] = {}
        at, in_round = 0, 0
        for replica, hashes, at_s, held in items:
            if not hashes:
                continue
            rid = self._rid(replica)
            gen = self.meta.gen(rid)
            used_ms = now_ms if at_s is None else to_ms(at_s)
            if held is not None:  # the replica's fresh held entries stay as they are
                kept = self._kept(rid, gen, used_ms, held, self.refresh_ms(replica, used_ms))
                self.blocks_kept += min(kept, len(hashes))
                hashes = hashes[kept:]
                if not hashes:
                    continue
            self.blocks_written += len(hashes)
            sizes[rid] = self._sizes(rid)
            for start in range(0, len(hashes), RECORD_CHUNK):
                chunk = hashes[start : start + RECORD_CHUNK]
                if in_round and in_round + len(chunk) > RECORD_ROUND_BLOCKS:
                    at, in_round = at + 1, 0
                keys, head = chain_call(chunk)
                calls.append((at, rid, (*keys, *head, rid, gen, used_ms, ttl_ms)))
                in_round += len(chunk)
        return calls, sizes

    def _sizes(self, rid: str) -> tuple[int, int]:
        """A replica's (blocks per generation, capacity)."""
        capacity = self._capacities.get(rid, self.capacity_blocks)
        return blocks_per_generation(capacity), capacity

    async def _count(
        self,
        rids: list[str],
        calls: list[tuple[int, str, tuple[Any, ...]]],
        replies: list[Any],
        sizes: dict[str, tuple[int, int]],
        now_ms: int,
    ) -> None:
        """A Cluster's records' new blocks and the generations they moved from (`RECORD`'s
        replies, one per call), one `COUNT` per replica (its meta slot is another master's)."""
        counts: dict[str, tuple[int, int, dict[int, int]]] = {}
        for rid, (_, _, call), reply in zip(rids, calls, replies, strict=False):
            new, flat = reply
            written = int(call[4])  # (key, prefix, blob, rid, generation, ...)
            n, _, moved = counts.get(rid, (0, written, {}))
            for i in range(0, len(flat), 2):
                g = int(flat[i])
                moved[g] = moved.get(g, 0) + int(flat[i + 1])
            counts[rid] = (n + int(new), written, moved)
        await asyncio.gather(
            *(
                self.meta.count(rid, n, moved, written, sizes[rid], now_ms)
                for rid, (n, written, moved) in counts.items()
            )
        )

    async def _pipelined(self, commands: list[tuple[Any, ...]], sources: list[str]) -> list[Any]:
        """Script calls in one write, in order (a single Redis: down `_writes`; a cluster: one
        pipeline, each master its share); a script Redis lost (a restart, `SCRIPT FLUSH`) is
        loaded and its calls sent again once. Raises the first error."""
        if self._writes is not None:  # a single Redis: down the writes' own connection
            answers = await asyncio.gather(
                *self._writes.commands(commands, None, sources), return_exceptions=True
            )
            for answer in answers:
                if isinstance(answer, BaseException):
                    raise answer
            return list(answers)
        pipe = self.client.pipeline()
        for command in commands:
            pipe.execute_command(*command)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        lost = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if lost:
            for source in dict.fromkeys(sources[i] for i in lost):
                await self.client.script_load(source)
            again = self.client.pipeline()
            for i in lost:
                again.execute_command(*commands[i])
            for i, reply in zip(lost, await again.execute(raise_on_error=False), strict=True):
                replies[i] = reply
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    async def place(
        self, replica: str, hashes: Sequence[BlockHash], ttl_s: float = PLACEMENT_TTL_S
    ) -> None:
        """A request was placed on `replica` and its engine has not written `hashes` yet: every
        gateway's lookup matches them there (with no last use: nothing for reconciliation to
        expire) for `ttl_s` or until the request's first token records them, whichever is
        first. Issue 39 item 3: the next turn, or a concurrent sibling, that another gateway
        gets goes where this one went."""
        if hashes:
            await self._pipelined([self._place_command(replica, hashes, ttl_s)], [scripts.PLACE])

    def _place_command(
        self, replica: str, hashes: Sequence[BlockHash], ttl_s: float
    ) -> tuple[Any, ...]:
        keys, head = chain_call(hashes)
        args = self.place_args(replica, ttl_s)
        return ("EVALSHA", self._place.sha, len(keys), *keys, *head, *args)

    def place_args(self, replica: str, ttl_s: float = PLACEMENT_TTL_S) -> tuple[Any, ...]:
        """`PLACE`'s arguments after the chain (rid, generation, expiry ms, ttl ms): a
        placement in flight on `replica` from now, also sent with a fan-out leader's marker
        (`MarkerStore.lead`'s `place`)."""
        rid = self._rid(replica)
        ttl_ms = int(ttl_s * 1000)
        return (rid, self.meta.gen(rid), to_ms(self.clock()) + ttl_ms, ttl_ms)

    async def restore(self, replica: str, entries: Sequence[tuple[BlockHash, float]]) -> int:
        """Write back entries (block, last use) a gateway kept while Redis lost them, at the
        replica's current generation; a block Redis holds with a later use is left alone, one
        past the TTL is not written. Returns the blocks written."""
        rid = self._rid(replica)
        now_ms = to_ms(self.clock())
        by_chain: dict[bytes, list[tuple[BlockHash, float]]] = {}
        for block, used in entries:
            by_chain.setdefault(block[:TAG_BYTES], []).append((block, used))
        written = 0
        for group in by_chain.values():
            for i in range(0, len(group), RESTORE_BATCH):
                batch = group[i : i + RESTORE_BATCH]
                keys, head = chain_call([block for block, _ in batch])
                uses = "".join(f"{to_ms(used)}," for _, used in batch)
                args: list[Any] = [*head, rid, self.meta.gen(rid), now_ms, int(self.ttl_s * 1000)]
                args.append(uses)
                written += int(await self._restore(keys=keys, args=args))
        if written:  # what it restored is live at the generation: counted as new
            gen = self.meta.gen(rid)
            await self.meta.count(rid, written, {}, gen, self._sizes(rid), now_ms)
        return written

    async def drop(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        if hashes:
            keys, head = chain_call(hashes)
            await self._drop(keys=keys, args=[*head, self._rid(replica)])

    def oldest_live(self, replica: str) -> int:
        """The oldest generation of `replica` whose entries its lookups match."""
        return self.meta.oldest(self._rid(replica))

    async def forget(self, replica: str) -> None:
        await self.meta.bump(self._rid(replica), "", "", to_ms(self.clock()))

    async def expire(self, replica: str, before_s: float) -> None:
        await self.meta.expire(self._rid(replica), to_ms(before_s))

    async def restarted(self, replica: str, start_marker: str, previous: str = "") -> bool:
        """Report the engine's start marker (its start time) and the one this gateway saw
        before ('' if none); a changed marker is a restart and bumps the epoch — once, however
        many gateways report the same restart, and even if Redis lost the marker it had."""
        rid = self._rid(replica)
        return await self.meta.bump(rid, start_marker, previous, to_ms(self.clock()))

    async def close(self) -> None:
        self._closing = True
        for task in self._tasks:
            await stop_task(task, 2 * GEN_REFRESH_S)
        await self.lane.close()
        if self._writes is not None:
            await self._writes.close()
        await self.client.aclose()

    # -- generations -------------------------------------------------------------------------
    def capacity_of(self, replica: str) -> int:
        """The replica's capacity in entries: the smaller of the setting and its engine's KV
        (`set_capacity`); between 3/4 and 3/2 of it match (`GENERATION_SHARE`)."""
        return self._capacities.get(replica_id(replica), self.capacity_blocks)

    def set_capacity(self, replica: str, engine_blocks: int | None) -> None:
        """The replica's engine holds `engine_blocks` directory entries' worth of KV (None:
        unknown, the setting applies). Its generation then advances after 3/4 of the smaller of
        that and the setting new blocks. Every gateway reads the same engine, so they agree;
        after a shrink the entries counted before still match until the generation has
        advanced twice (the replica's next 3/2 `capacity` new blocks at most)."""
        rid = replica_id(replica)
        if engine_blocks is None or engine_blocks >= self.capacity_blocks:
            self._capacities.pop(rid, None)
        else:
            self._capacities[rid] = max(engine_blocks, 2)

    def register(self, replicas: Iterable[str]) -> None:
        """The replica names this gateway routes to (lookups report only these)."""
        for name in replicas:
            self._rid(name)

    def registered(self) -> list[str]:
        """The replica names this gateway routes to."""
        return sorted(self._names.values())

    def unregister(self, replica: str) -> None:
        """This gateway no longer routes to the replica (discovery saw it leave)."""
        rid = replica_id(replica)
        if self._names.pop(rid, None) is not None:
            self._replica_arg = None
        self._capacities.pop(rid, None)
        self.meta.forget_replica(rid)

    async def refresh_generations(self) -> None:
        """Reload every replica's generation and floor (all live in the meta slot); when Redis
        lost its state, write back what this gateway knows and call `on_reset`."""
        try:
            reset = await self.meta.refresh()
        except DirectoryLayoutError as exc:
            self.layout_error = exc
            raise
        if reset and self.on_reset is not None:
            self.on_reset()

    async def prune(self) -> int:
        """Prune replicas quiet for `PRUNE_HORIZON_TTLS` TTLs from the meta hashes."""
        horizon_ms = int(PRUNE_HORIZON_TTLS * self.ttl_s * 1000)
        return await self.meta.prune(to_ms(self.clock()), horizon_ms)

    async def start(self) -> None:
        """Load the generations and keep them fresh: the channel, and the poll behind it; open
        the lookups' connection."""
        await self.refresh_generations()
        await self.lane.warm()
        self._tasks = [
            asyncio.create_task(self._watch_generations(), name="generations channel"),
            asyncio.create_task(self._poll_generations(), name="generations poll"),
        ]

    async def _poll_generations(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing:
            await asyncio.sleep(GEN_REFRESH_S)
            try:
                await self.refresh_generations()
                if loop.time() - self._last_prune >= PRUNE_INTERVAL_S:
                    self._last_prune = loop.time()
                    await self.prune()
            except asyncio.CancelledError:
                raise
            except DirectoryLayoutError as exc:
                log.error("%s", exc)
            except Exception as exc:  # Redis away: lookups fall back meanwhile
                log.debug("generation poll: %s", exc)

    async def _watch_generations(self) -> None:
        while not self._closing:
            try:
                pubsub = self.client.pubsub()
                await pubsub.subscribe(CHANNEL)
                try:
                    while not self._closing:
                        message = await pubsub.get_message(timeout=GEN_REFRESH_S)
                        if message is None:
                            continue
                        if message["type"] == "message":
                            self.meta.apply(text(message["data"]))
                        elif message["type"] == "subscribe":  # the server confirmed it
                            self._subscription(True, None)
                finally:
                    self.subscribed = False
                    await close_pubsub(pubsub)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away, or pub/sub refused: the poll carries on
                self._subscription(False, exc)
                await asyncio.sleep(GEN_REFRESH_S)

    def _subscription(self, up: bool, exc: BaseException | None) -> None:
        """Log each change of the subscription's state once."""
        if up:
            if self._subscription_failed:
                log.warning("directory channel %s subscribed again", CHANNEL)
            self._subscription_failed = False
        elif not self._subscription_failed:
            self._subscription_failed = True
            log.warning(
                "cannot subscribe to the directory channel %s (%s: %s): generations are polled "
                "every %.0f s instead",
                CHANNEL,
                type(exc).__name__,
                exc,
                GEN_REFRESH_S,
            )
        self.subscribed = up

    def _meta_changed(self) -> None:
        self._replica_arg = None

    def _epoch(self, rid: str) -> None:
        name = self._names.get(rid)
        if name is not None and self.on_epoch is not None:
            self.on_epoch(name)

    def _rid(self, replica: str) -> str:
        rid = replica_id(replica)
        if rid not in self._names:
            self._names[rid] = replica
            self._replica_arg = None
        return rid
