"""The event index in Redis / Redis Cluster: what the engines' KV events say each cache domain
holds, written by the domain's one owner (`EventWriter`), read by every gateway (`EventReader`).

The in-process `cachemap.events.EventIndex` keeps the same facts per gateway; this one keeps
them once per fleet (docs/precise.md, "Who ingests"). Key schema (`{...}`: the cluster hash tag):

    kvg:{TAG}:<suffix>:e      HASH  domain id -> "<epoch>:<tier mask digit>[:<prefix mark>]"
                                    (no TTL: an engine does not re-announce a block it reuses)
    kvg:{TAG}:<suffix>:s      HASH  domain id -> "<epoch>:<expiry, Redis ms>"  a speculative
                                    entry (any gateway's placement), PX = the speculative ttl
    kvg:{kvg-ev}:domains      HASH  domain id -> "<epoch>|<domain name>"  (present: events flow)
    kvg:{kvg-ev}:lease:<id>   STR   the owning gateway's id, PX = the lease  (`Leases`)
    kvg:{kvg-ev}:gateways     HASH  gateway id -> "<expiry ms>:<domains owned>" (`Leases.heartbeat`)
    kvg:{kvg-ev:<id>}:map     HASH  engine hash -> own key (16 bytes) + tier mask digit
                                    + "r" (a chain's first block) or "p" + its parent's own key
    kvg:{kvg-ev:<id>}:feed    HASH  next_seq (the seq after the last batch written), sliding

The keys and the Lua scripts are in `cachemap.redis.event_scripts`. TAG and suffix are the
directory's (`schema.chain_call`): every block of one chain is in one slot, so a lookup is one
script call; a domain id is `schema.replica_id(domain)`.

Invariants:
- Only a domain's owner writes its fields, map and feed hash; its in-memory state (`_Owned`)
  is the truth and Redis the copy, so a write sets an absolute mask (never read-modify-write)
  and the writes pending for a key coalesce to the last one.
- A wipe (AllBlocksCleared, a restart) bumps the domain's epoch: a lookup counts a field only
  at the epoch it was given, and the epochs are read with the lookup (on one Redis in the
  script itself, which answers on the current ones and says when they moved; in a cluster in
  the same pipeline, the reader retrying with the new ones) — so once the bump is written no
  lookup anywhere matches the wiped blocks, before any cleanup ran. Old-epoch fields are then
  deleted in the background (`CLEAN` deletes only fields of an older epoch).
- A speculative entry (`EventReader.speculate`: the gateway that placed a request, for the
  blocks past what the index already matched there) counts, like the in-process one, as a GPU
  block of the domain until it expires (Redis's clock) or the domain's epoch moves; a fan-out
  sibling routed by another gateway before the leader's event sees it. Once the block's event
  is written its `:e` field matches instead (a lookup reads `:s` only for a block without
  one), the owner's write of its removal deletes the domain's entry, and a block the domain
  already holds gets none: a block the engine evicts within the ttl of its placement is not
  claimed past its removal.
- Prefix marks: a block's field carries a mark when every block of its prefix (the chain up
  to and including it; an own key names its whole prefix) is held by the domain, with the count
  of those on no GPU. The owner keeps each block's parent and children and, when a block comes
  or goes (or moves tier), re-marks the blocks below it in the same flush: a lookup bisects to
  the deepest marked block of its chain and reads block by block only past it (`LOOKUP`; a
  6,000-block chain costs ~13 reads and not 6,000). A mark is only ever a shortcut: a block
  without one is read as before.
- A flush's block writes go in script calls of at most `WRITE_CHUNK` blocks, its map writes in
  calls of `MAP_CHUNK` (Redis serves other clients between two), the block writes in an order
  under which no lookup between two calls sees a mark whose prefix is not all there: the writes
  without a mark first (they only ever take a claim away), then the deletions, each block's
  deleted descendants before it, then the marked writes, each block's marked ancestors before
  it (`_write_order`). A chain is in one slot, so its calls go to one node, in that order.
- The map and `next_seq` let a new owner (a takeover, a restarted gateway) continue where the
  last one stopped: parents resolve, removals apply, and the seq says what to replay.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError

from cachemap.events import (
    CPU,
    GPU,
    STORAGE,
    BlockRemoved,
    BlockStored,
    CacheEvent,
    EngineHash,
    IndexStats,
    Match,
    stored_keys,
)
from cachemap.keys import TAG_BYTES, BlockHash
from cachemap.recency import DomainRecency
from cachemap.redis.client import AnyRedis
from cachemap.redis.event_scripts import (
    CLEAN,
    DOMAIN,
    DOMAINS_KEY,
    FEED,
    FEED_OWNER,
    GATEWAYS,
    GATEWAYS_KEY,
    LOOKUP,
    MAP,
    OWNERS_KEY,
    RELEASE,
    RENEW,
    SPECULATE,
    WRITE,
    WRITE_BYTES,
    digit,
    engine_hash_of,
    feed_key,
    lease_key,
    map_key,
    map_record,
    record,
    write_record,
)
from cachemap.redis.lookups import LookupLane
from cachemap.redis.node_lanes import NodeLanes
from cachemap.redis.schema import chain_call, replica_id, text

log = logging.getLogger(__name__)

MAX_SPECULATING = 256
"""Speculative writes in flight per gateway: beyond it a placement's entry is not shared (it is
still entered in process). Each is one script call of ~0.1 ms; 256 are a burst of ~25 ms."""
WRITE_CHUNK = 128
"""Block writes per `WRITE` call (~4 kB of arguments, well under a ms of Redis): between two
calls Redis serves the lookups. One call a flush held a lookup ~25 ms behind a 20,000-block
batch, up to ~0.3 s live at 10% KV; calls of 128 hold it ~2-4 ms, for a flush 0-20% longer
(`tools.flush_stall`; 512 held it ~3.5-5.5 ms, against the lookups' 5-ms deadline)."""
SPECULATE_CHUNK = 128
"""Blocks per `SPECULATE` call. A placement's entry covers the chain past what the domain
holds, thousands of blocks for an agent's 50k-115k-token prompt (16-token blocks) at ~6 µs of
Redis a block: one call held Redis 11 ms at 1,800 blocks and 41 ms at 6,000 (quiet), 24 ms
median and up to 0.3 s live at two gateways on a loaded machine, and the lookups queued behind
it passed their 25-ms cap (issue 39; docs/design/directory.md, "A long chain's writes")."""
SPECULATE_ROUND = 4
"""`SPECULATE` calls per pipeline, the pipelines one after another. Redis runs a pipeline that
arrived whole before it reads another client: a `GET` on another connection waited 45-100 ms
behind 47 calls sent in one pipeline, 8-30 ms behind pipelines of 8 and 2-13 ms behind single
calls (load ~3.5-5). Single calls cost a round trip each: +9% of the tier's CPU per request
at two gateways, +30% at four. Four a pipeline: 512 blocks, ~3 ms of Redis quiet."""
MAP_CHUNK = 256
"""Map fields set or deleted per `MAP` call (~10 kB; a field costs Redis less than a block)."""
MAX_PENDING_BLOCKS = 4096
"""Block writes a feed may queue before it waits for a flush: ~20 ms of writes, and the
backpressure that keeps a burst in the SUB socket's queue rather than in memory."""
CLEAN_CHUNK = 4096
"""Old-epoch fields deleted per flush after a wipe: a wipe of 300k blocks is cleaned in ~70
flushes without holding Redis for more than ~2 ms at a time."""


@dataclass
class _Owned:
    """One owned domain: the truth this writer keeps, and what it has not written yet."""

    rid: str
    token: str = ""
    """This owner's token, set in Redis at adoption (fencing: every write script checks it)."""
    epoch: int = 0
    next_seq: int | None = None
    engine: dict[EngineHash, BlockHash] = field(default_factory=dict)
    masks: dict[BlockHash, int] = field(default_factory=dict)
    sliding: set[int] = field(default_factory=set)
    tier_counts: dict[int, int] = field(
        default_factory=lambda: dict.fromkeys((GPU, CPU, STORAGE), 0)
    )
    blocks: dict[BlockHash, int] = field(default_factory=dict)
    """Pending block writes: own key -> mask (0: delete)."""
    mapping: dict[EngineHash, bytes | None] = field(default_factory=dict)
    """Pending map writes: engine hash -> own key + mask digit (None: delete)."""
    cleared: bool = False
    """A wipe not written yet: the epoch bump, the map dropped."""
    sliding_changed: bool = False
    stale: list[BlockHash] = field(default_factory=list)
    """Keys of older epochs whose fields are still to be cleaned."""
    dirty: bool = False
    recency: DomainRecency | None = None
    """The GPU blocks in eviction order (`track_recency`; `cachemap.redis.frontiers`)."""
    recency_moved: bool = False
    """The order changed since it was last published."""
    published_s: float = float("-inf")
    published_epoch: int = -1
    parents: dict[BlockHash, bytes] = field(default_factory=dict)
    """Held block -> its parent's own key (`ROOT`: a chain's first block); absent: unknown (a
    block adopted from a map written without parents), so never marked."""
    children: dict[bytes, BlockHash | list[BlockHash]] = field(default_factory=dict)
    """Own key -> the held block whose parent it is, or a list of them when the chain branches
    there (kept while any is held, whether the key is held or not)."""
    marks: dict[BlockHash, int] = field(default_factory=dict)
    """Held block whose whole prefix is held -> the blocks of that prefix on no GPU."""
    removed: dict[BlockHash, bytes] = field(default_factory=dict)
    """Pending deletions' parents (`_write_order`: a block's deleted descendants go first)."""


ROOT = b""
"""A chain's first block's parent (`_Owned.parents`)."""
REFUSED = -1
"""A write script's answer when the writer is not the domain's current owner (fencing)."""


@dataclass
class _Pending:
    """One domain's writes taken out of its state for a flush, put back if it fails."""

    blocks: dict[BlockHash, int]
    removed: dict[BlockHash, bytes]
    mapping: dict[EngineHash, bytes | None]
    cleared: bool
    stale: list[BlockHash]
    sliding_changed: bool
    epoch: int

    @classmethod
    def take(cls, state: _Owned) -> _Pending:
        pending = cls(
            state.blocks,
            state.removed,
            state.mapping,
            state.cleared,
            state.stale[:CLEAN_CHUNK],
            state.sliding_changed,
            state.epoch,
        )
        state.blocks, state.removed, state.mapping, state.cleared = {}, {}, {}, False
        state.stale = state.stale[CLEAN_CHUNK:]
        state.sliding_changed = False
        state.dirty = bool(state.stale)
        return pending

    def restore(self, state: _Owned) -> None:
        """Put the writes back under those queued since (newer writes win); a wipe since made
        the blocks, removals and map writes void."""
        if self.epoch == state.epoch:
            state.blocks = {**self.blocks, **state.blocks}
            state.removed = {**self.removed, **state.removed}
            state.mapping = {**self.mapping, **state.mapping}
        state.cleared = state.cleared or self.cleared
        state.stale = self.stale + state.stale
        state.sliding_changed = state.sliding_changed or self.sliding_changed
        state.dirty = True


class EventWriter:
    """The owner's side: events applied to owned domains in memory, written to Redis in
    pipelined batches (see the module docstring for the invariants).

    `apply` and `clear` are synchronous (the `Feed` calls them between two awaits); `commit`
    after each batch schedules a flush, and waits for it on a wipe or a backlog."""

    def __init__(
        self,
        client: AnyRedis,
        *,
        block_size: int,
        track_recency: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.block_size = block_size
        self.track_recency = track_recency
        """Keep each owned domain's GPU blocks in eviction order, as the in-process index
        does (a policy reads frontiers: `cachemap.redis.frontiers` publishes them)."""
        self.clock = clock
        self.cluster = isinstance(client, RedisCluster)
        self.stats = IndexStats()
        self.committed_epochs: dict[str, int] = {}
        """domain -> the epoch last written (a wipe is in Redis once this moved)."""
        self.flushes = 0
        self.flush_errors = 0
        self.fenced = 0
        """Domains dropped because Redis refused their writes: another owner adopted them."""
        self._owned: dict[str, _Owned] = {}
        self._lock = asyncio.Lock()
        self._scheduled = False
        self._failing = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._write = client.register_script(WRITE)
        self._clean = client.register_script(CLEAN)
        self._map = client.register_script(MAP)
        self._feed = client.register_script(FEED)
        self._domain = client.register_script(DOMAIN)

    # -- ownership -------------------------------------------------------------------------
    async def adopt(self, domain: str) -> int | None:
        """Take over a domain: load what its last owner wrote; returns the seq to expect next
        (None: never written)."""
        rid = replica_id(domain)
        state = _Owned(rid, await self._fence(rid))
        current = await self.client.hget(DOMAINS_KEY, rid)
        if current is not None:
            state.epoch = int(text(current).split("|", 1)[0])
        feed = await self.client.hgetall(feed_key(rid))
        seq = feed.get(b"next_seq")
        state.next_seq = int(seq) if seq is not None else None
        sliding = feed.get(b"sliding")
        if sliding:
            state.sliding = {int(g) for g in text(sliding).split(",")}
        async for name, value in self.client.hscan_iter(map_key(rid), count=10_000):
            key, mask = BlockHash(bytes(value[:16])), int(value[16:17])
            state.engine[engine_hash_of(name)] = key
            state.masks[key] = state.masks.get(key, 0) | mask
            parent = value[17:18]
            if parent == b"r":
                state.parents[key] = ROOT
            elif parent == b"p":
                state.parents[key] = bytes(value[18:34])
        for key, parent in state.parents.items():
            _add_child(state.children, parent, key)
        for key in _children(state.children, ROOT):  # the marks the last owner wrote
            _mark(state, key, write=False)
        for mask in state.masks.values():
            for tier in (GPU, CPU, STORAGE):
                if mask & tier:
                    state.tier_counts[tier] += 1
        if self.track_recency:  # which blocks are held is known, their order is not
            state.recency = DomainRecency()
            state.recency.use([k for k, m in state.masks.items() if m & GPU], self.clock())
            state.recency_moved = True
        self._owned[domain] = state
        self.committed_epochs[domain] = state.epoch
        return state.next_seq

    async def _fence(self, rid: str) -> str:
        """A new owner token for the domain, in the owners hash and then the feed hash (their
        two slots): from here the last owner's writes are refused (a write of its that lands
        before the feed hash's copy changes is read by `adopt` right after, as its own)."""
        token = secrets.token_hex(8)
        await self.client.hset(OWNERS_KEY, rid, token)
        await self.client.hset(feed_key(rid), FEED_OWNER, token)
        return token

    async def retake(self, domain: str) -> int:
        """`rewrite` under a new owner token: the lease was gone and is taken again (Redis
        may have lost the owners hash with the rest)."""
        state = self._owned.get(domain)
        if state is None:
            return 0
        state.token = await self._fence(state.rid)
        return self.rewrite(domain)

    async def release(self, domain: str, *, flush: bool = True) -> None:
        """Stop owning a domain: what is pending is written first (best effort), unless the
        lease is already lost (`flush=False`: another owner may be writing)."""
        if domain in self._owned and not flush:
            self._owned.pop(domain)
        elif domain in self._owned:
            try:
                await self.flush()
            except Exception as exc:  # Redis away: the next owner replays what it can
                log.warning("events of %s: last writes lost on release: %s", domain, exc)
            self._owned.pop(domain, None)

    def rewrite(self, domain: str) -> int:
        """Queue the whole of an owned domain again (Redis lost it: the lease was gone with no
        new holder); returns the blocks queued. Its epoch is kept: no reader counts an older."""
        state = self._owned.get(domain)
        if state is None:
            return 0
        state.blocks = dict(state.masks)
        state.mapping = {h: _map_value(state, k) for h, k in state.engine.items()}
        state.sliding_changed = bool(state.sliding)
        self._touch(state)
        return len(state.blocks)

    def owns(self, domain: str) -> bool:
        return domain in self._owned

    # -- events (the EventSink protocol) -----------------------------------------------------
    def apply(self, domain: str, event: CacheEvent) -> None:
        state = self._owned.get(domain)
        if state is None:  # released while the batch was in flight
            return
        if isinstance(event, BlockStored):
            self._store(state, event)
        elif isinstance(event, BlockRemoved):
            self._remove(state, event)
        else:
            self.clear(domain)
        self._touch(state)

    def _store(self, state: _Owned, event: BlockStored) -> None:
        if not event.full_attention:
            if event.group_idx is not None and event.group_idx not in state.sliding:
                state.sliding.add(event.group_idx)
                state.sliding_changed = True
            self.stats.skipped_groups += 1
            return
        if event.block_size != self.block_size:
            self.stats.wrong_block_size += 1
            return
        parent_key = None
        if event.parent is not None:
            parent_key = state.engine.get(event.parent)
            if parent_key is None:
                self.stats.unresolved_parents += 1
                return
        keys = stored_keys(event, parent_key, self.block_size)
        tier = event.tier
        parent: bytes = ROOT if parent_key is None else parent_key
        parents, children, marks = state.parents, state.children, state.marks
        above = 0 if parent_key is None else marks.get(parent_key)
        for engine_hash, key in zip(event.block_hashes, keys, strict=False):
            mask = state.masks.get(key, 0)
            changed = not mask & tier
            if changed:
                state.tier_counts[tier] += 1
                mask |= tier
                state.masks[key] = mask
                state.blocks[key] = mask
            if key in parents:
                if changed:
                    _mark(state, key)
            elif key in children:  # (adopted without its parent, and has children)
                parents[key] = parent
                _add_child(children, parent, key)
                changed = True
                _mark(state, key)
            else:  # a new block at the end of its chain: its mark is its parent's
                parents[key] = parent
                _add_child(children, parent, key)
                changed = True
                if above is not None:
                    marks[key] = above if mask & GPU else above + 1
                    state.blocks[key] = mask
            if changed or state.engine.get(engine_hash) != key:
                state.engine[engine_hash] = key
                state.mapping[engine_hash] = _map_value(state, key)
            parent = key
            above = marks.get(key)
        if tier == GPU and state.recency is not None:
            state.recency.use(keys[: len(event.block_hashes)], self.clock())
            state.recency_moved = True
        self.stats.stored_blocks += len(keys)

    def _remove(self, state: _Owned, event: BlockRemoved) -> None:
        if event.group_idx is not None and event.group_idx in state.sliding:
            self.stats.skipped_groups += 1
            return
        tier = event.tier
        moved: list[BlockHash] = []
        for engine_hash in event.block_hashes:
            key = state.engine.get(engine_hash)
            mask = state.masks.get(key, 0) if key is not None else 0
            if key is None or not mask & tier:
                self.stats.unknown_removals += 1
                continue
            state.tier_counts[tier] -= 1
            self.stats.removed_blocks += 1
            if tier == GPU and state.recency is not None:
                state.recency.remove(key)
                state.recency_moved = True
            mask &= ~tier
            state.blocks[key] = mask
            if mask:
                state.masks[key] = mask
                state.mapping[engine_hash] = _map_value(state, key)
            else:
                del state.masks[key]
                del state.engine[engine_hash]
                state.mapping[engine_hash] = None
                parent = state.parents.pop(key, None)
                if parent is not None:
                    _drop_child(state.children, parent, key)
                    state.removed[key] = parent
            moved.append(key)
        # the marks after the masks, deepest first: an engine evicts a chain from its end, and
        # a chain removed whole then costs one step a block, not a walk of what is below it
        for key in reversed(moved):
            if key in state.masks or key in state.children:
                _mark(state, key)
            else:
                state.marks.pop(key, None)

    def clear(self, domain: str) -> None:
        """A wipe or a restart: a new epoch (written by the next flush), nothing kept."""
        state = self._owned.get(domain)
        self.stats.clears += 1
        if state is None:
            return
        state.stale.extend(state.masks)
        state.epoch += 1
        state.engine.clear()
        state.masks.clear()
        state.blocks.clear()
        state.mapping.clear()
        state.parents.clear()
        state.children.clear()
        state.marks.clear()
        state.removed.clear()
        state.sliding.clear()
        state.tier_counts = dict.fromkeys((GPU, CPU, STORAGE), 0)
        state.cleared = True
        if state.recency is not None:
            state.recency = DomainRecency()
            state.recency_moved = True
        self._touch(state)

    async def commit(self, domain: str, next_seq: int | None, wiped: bool) -> None:
        """After a batch: remember its seq; wait for the flush on a wipe or a backlog."""
        state = self._owned.get(domain)
        if state is None:
            return
        state.next_seq = next_seq
        self._touch(state)
        if wiped or state.cleared or len(state.blocks) >= MAX_PENDING_BLOCKS:
            await self._flush_or_log()

    def _touch(self, state: _Owned) -> None:
        state.dirty = True
        if self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # applied outside a loop (a benchmark): flushed by hand
            return
        self._scheduled = True
        loop.call_soon(self._spawn_flush)

    def _spawn_flush(self) -> None:
        self._scheduled = False
        task = asyncio.create_task(self._background_flush())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _background_flush(self) -> None:
        await self._flush_or_log()

    async def _flush_or_log(self) -> None:
        """A flush that never raises: a failed one keeps its writes pending for the next (the
        feed goes on; Redis away is logged once, and once when it is back)."""
        try:
            await self.flush()
        except Exception as exc:
            if not self._failing:
                log.warning("KV events: writing to Redis failed (kept, retried): %s", exc)
            self._failing = True
            return
        if self._failing:
            log.warning("KV events: writing to Redis again")
        self._failing = False

    # -- eviction order (`track_recency`: each owned domain's `recency`, made at adoption) ------
    def touch(self, domain: str, keys: Sequence[BlockHash], now_s: float) -> int:
        """A placement on an owned domain uses its leading blocks there: they become the
        newest. Returns how many it held (0: not owned, or not tracking)."""
        state = self._owned.get(domain)
        if state is None or state.recency is None:
            return 0
        held = state.recency.touch(keys, now_s)
        state.recency_moved = state.recency_moved or held > 0
        return held

    def eviction_runs(
        self, domain: str, depth: int, now_s: float, exclude: Sequence[BlockHash] = ()
    ) -> tuple[tuple[int, float], ...]:
        """An owned domain's next evicted GPU blocks, but for `exclude` (`DomainRecency.runs`)."""
        state = self._owned.get(domain)
        if state is None or state.recency is None:
            return ()
        return state.recency.runs(depth, now_s, exclude)

    def take_moved_frontiers(
        self, max_runs: int, now_s: float, every_s: float
    ) -> list[tuple[str, int, int, list[tuple[int, float]]]]:
        """(domain, epoch, GPU blocks, oldest runs) of each owned domain whose order moved
        since it was last taken, at most once per `every_s` (a new epoch at once: until it
        is published the domain has no frontier anywhere); they count as published
        (`frontiers_moved` puts one back)."""
        out = []
        for domain, state in self._owned.items():
            if not state.recency_moved or state.recency is None:
                continue
            if now_s - state.published_s < every_s and state.published_epoch == state.epoch:
                continue
            state.recency_moved = False
            state.published_s, state.published_epoch = now_s, state.epoch
            runs = state.recency.oldest(max_runs)
            out.append((domain, state.epoch, state.tier_counts[GPU], runs))
        return out

    def frontiers_moved(self, domains: Iterable[str]) -> None:
        for domain in domains:
            state = self._owned.get(domain)
            if state is not None:
                state.recency_moved = True

    # -- writing -----------------------------------------------------------------------------
    async def flush(self) -> None:
        """Write everything pending, one pipeline (in a cluster, one per node, in parallel).
        Every write sets an absolute value, so a pipeline sent again does no harm."""
        async with self._lock:
            for attempt in range(2):
                try:
                    await self._flush_once()
                    return
                except NoScriptError:
                    if attempt:
                        self.flush_errors += 1
                        raise
                    for script in (WRITE, CLEAN, MAP, FEED, DOMAIN):  # every primary
                        await self.client.script_load(script)

    async def _flush_once(self) -> None:
        """One pipeline of every dirty domain's pending writes. Each domain's writes are taken
        out of its state and built into commands inside a `try`: a domain whose commands
        cannot be built (a bug, or a value no script carries) gets its writes back and is left
        out, and every domain gets its writes back when the pipeline fails (issue 45, item 7:
        they were taken before the `try`, so one engine's bad block dropped every domain queued
        before it). The first such error is raised after the others were written."""
        taken = [(d, s) for d, s in self._owned.items() if s.dirty]
        if not taken:
            return
        pipe = self.client.pipeline() if self.cluster else self.client.pipeline(False)
        undo: list[tuple[str, _Owned, _Pending]] = []
        spans: list[int] = [0]
        """Each domain's commands' end in the pipeline (its results' span)."""
        unbuilt: Exception | None = None
        for domain, state in taken:
            pending = _Pending.take(state)
            try:
                commands = self._commands(domain, state, pending)
            except Exception as exc:
                pending.restore(state)
                self.flush_errors += 1
                log.error("KV events of %s: writes not built (kept, retried): %r", domain, exc)
                unbuilt = unbuilt or exc
                continue
            for args in commands:
                pipe.execute_command(*args)
            undo.append((domain, state, pending))
            spans.append(spans[-1] + len(commands))
        if undo:
            try:
                results = await pipe.execute(raise_on_error=False)
                errors = [r for r in results if isinstance(r, Exception)]
                if errors:
                    raise next((e for e in errors if isinstance(e, NoScriptError)), errors[0])
            except Exception as exc:
                # a Redis that lost its scripts (a restart, a fresh server) is not a failure:
                # `flush` loads them and sends the pipeline again (counted if that fails too)
                if not isinstance(exc, NoScriptError):
                    self.flush_errors += 1
                for _, state, pending in undo:  # put back what was taken, newer writes win
                    pending.restore(state)
                raise
            self.flushes += 1
            for i, (domain, state, _) in enumerate(undo):
                if REFUSED in results[spans[i] : spans[i + 1]]:
                    self._fenced(domain, state)
                else:
                    self.committed_epochs[domain] = state.epoch
        if unbuilt is not None:
            raise unbuilt

    def _fenced(self, domain: str, state: _Owned) -> None:
        """Redis refused a flush of the domain: another gateway adopted it (this owner stalled
        past its lease). Its state here is void: dropped, the feed's writes ignored from now
        (`apply` of a domain not owned), until the intake's next round closes the feed."""
        if self._owned.get(domain) is state:
            del self._owned[domain]
        self.fenced += 1
        log.warning("KV events of %s: writes refused, another gateway owns them now", domain)

    def _commands(self, domain: str, state: _Owned, pending: _Pending) -> list[tuple[Any, ...]]:
        """The commands that write one domain's `pending` writes (taken from `state`), each a
        script that checks the owner token (`REFUSED` when it is not the domain's current
        owner's; in a cluster the block writes cannot reach the owners hash, and are fenced by
        the epoch alone: the domains hash never goes back)."""
        rid, token = state.rid, state.token
        blocks, removed, stale = pending.blocks, pending.removed, pending.stale
        out: list[tuple[Any, ...]] = []
        domains_value = f"{state.epoch}|{domain}"
        domains = ("EVALSHA", self._domain.sha, 2, DOMAINS_KEY, OWNERS_KEY, rid, token)
        feed_keys = (feed_key(rid), map_key(rid))
        if pending.cleared:
            out.append((*domains, domains_value))
            out.append(("EVALSHA", self._feed.sha, 2, *feed_keys, token, "1"))
        marks = state.marks
        if len(blocks) > WRITE_CHUNK:  # (fewer: one call per chain slot, atomic, any order)
            order: Iterable[BlockHash] = _write_order(blocks, marks, state.parents, removed)
        else:
            order = blocks
        writes = ((k, write_record(k, blocks[k], marks.get(k))) for k in order)
        step = WRITE_CHUNK * WRITE_BYTES
        owners = () if self.cluster else (OWNERS_KEY,)  # (another slot in a cluster)
        for slot, blob in self._groups(writes):
            for at in range(0, len(blob), step):
                chunk = blob[at : at + step]
                write = (self._write.sha, 1 + len(owners), slot, *owners, rid, state.epoch)
                out.append(("EVALSHA", *write, chunk, token))
        for records in self._groups((k, record(k, 0)) for k in stale):
            clean = (self._clean.sha, 1 + len(owners), records[0], *owners, rid, state.epoch)
            out.append(("EVALSHA", *clean, records[1], token))
        if pending.mapping:
            fields = [map_record(h, v) for h, v in pending.mapping.items()]
            for at in range(0, len(fields), MAP_CHUNK):
                blob = b"".join(fields[at : at + MAP_CHUNK])
                out.append(("EVALSHA", self._map.sha, 2, map_key(rid), feed_key(rid), blob, token))
        feed: list[Any] = []
        if state.next_seq is not None:
            feed += ["next_seq", state.next_seq]
        if pending.sliding_changed:
            feed += ["sliding", ",".join(str(g) for g in sorted(state.sliding))]
        if feed:
            out.append(("EVALSHA", self._feed.sha, 2, *feed_keys, token, "0", *feed))
        out.append((*domains, domains_value))
        if state.stale:
            self._touch(state)
        return out

    def _groups(self, items: Iterable[tuple[BlockHash, bytes]]) -> list[tuple[bytes, bytes]]:
        """(a key naming the slot, the records' blob) per script call: one call in all on a
        single server, one per chain tag in a cluster (a script stays in one slot)."""
        by_tag: dict[bytes, list[bytes]] = {}
        for key, blob in items:
            tag = key[:TAG_BYTES] if self.cluster else b""
            records = by_tag.get(tag)
            if records is None:
                records = by_tag[tag] = [chain_call([key])[0][0]]
            records.append(blob)
        return [(r[0], b"".join(r[1:])) for r in by_tag.values()]

    # -- reading (metrics) ---------------------------------------------------------------------
    def domains(self) -> list[str]:
        return sorted(self._owned)

    def num_blocks(self, domain: str, tier: int = GPU) -> int:
        state = self._owned.get(domain)
        return state.tier_counts[tier] if state is not None else 0

    def pending_blocks(self) -> int:
        return sum(len(s.blocks) for s in self._owned.values())

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _write_order(
    blocks: dict[BlockHash, int],
    marks: dict[BlockHash, int],
    parents: dict[BlockHash, bytes],
    removed: dict[BlockHash, bytes],
) -> list[BlockHash]:
    """A flush's block writes in an order that is safe to split into calls (module docstring):
    the unmarked writes, the deletions with each block's deleted descendants before it, the
    marked writes with each block's marked ancestors before it. Under it, after any prefix of
    the writes, every mark in Redis has its whole prefix there: an unmarked write only takes a
    claim away; a deleted block's held descendants are among the unmarked writes (the owner
    re-marked them) and its deleted ones come before it; a marked block's ancestors are marked
    too, so each is in Redis already or a marked write before it."""
    unmarked: list[BlockHash] = []
    deleted: list[BlockHash] = []
    marked: list[BlockHash] = []
    for key, mask in blocks.items():
        if not mask:
            deleted.append(key)
        elif key in marks:
            marked.append(key)
        else:
            unmarked.append(key)
    unmarked += reversed(_ancestors_first(deleted, removed))
    unmarked += _ancestors_first(marked, parents)
    return unmarked


def _ancestors_first(keys: list[BlockHash], parents: dict[BlockHash, bytes]) -> list[BlockHash]:
    """`keys` ordered so that each comes after those of its ancestors among them: O(len(keys)),
    and one step a key when they come in chain order already (a chain stored, the common case)."""
    up = cast(dict[bytes, bytes], parents)
    pending = dict.fromkeys(keys)
    out: list[BlockHash] = []
    for key in keys:
        if key not in pending:
            continue
        parent = up.get(key)
        if parent not in pending:  # (ROOT, b"", never is)
            del pending[key]
            out.append(key)
            continue
        path: list[bytes] = [key]
        while parent in pending:
            assert parent is not None
            path.append(parent)
            parent = up.get(parent)
        for k in path:
            del pending[BlockHash(k)]
        out += cast(list[BlockHash], path[::-1])
    return out


def _map_value(state: _Owned, key: BlockHash) -> bytes:
    """A block's map value: its own key, mask digit, and parent (when known)."""
    value = key + digit(state.masks.get(key, 0))
    parent = state.parents.get(key)
    if parent is None:
        return value
    return value + (b"r" if parent == ROOT else b"p" + parent)


def _add_child(
    children: dict[bytes, BlockHash | list[BlockHash]], parent: bytes, key: BlockHash
) -> None:
    below = children.get(parent)
    if below is None:
        children[parent] = key
    elif isinstance(below, list):
        below.append(key)
    else:
        children[parent] = [below, key]


def _drop_child(
    children: dict[bytes, BlockHash | list[BlockHash]], parent: bytes, key: BlockHash
) -> None:
    below = children.get(parent)
    if isinstance(below, list):
        below.remove(key)
        if len(below) == 1:
            children[parent] = below[0]
    elif below == key:
        del children[parent]


def _children(children: dict[bytes, BlockHash | list[BlockHash]], parent: bytes) -> list[BlockHash]:
    below = children.get(parent)
    if below is None:
        return []
    return list(below) if isinstance(below, list) else [below]


def _mark(state: _Owned, key: BlockHash, *, write: bool = True) -> None:
    """Bring `key`'s prefix mark, and its descendants', up to date with the blocks held (its
    mask or parent just changed); each block whose mark changed is queued for writing. A
    block's mark is its parent's plus one if it is on no GPU; it has none when it is not held,
    its parent is unknown, or its parent has none. A block stored at the end of its chain (the
    common case) has no children: no walk."""
    masks, marks, children = state.masks, state.marks, state.children
    stack: list[BlockHash] | None = None
    k = key
    while True:
        mask = masks.get(k, 0)
        mark: int | None = None
        if mask:
            parent = state.parents.get(k)
            if parent is not None:
                above = 0 if parent == ROOT else marks.get(BlockHash(parent))
                if above is not None:
                    mark = above if mask & GPU else above + 1
        if mark != marks.get(k, None):
            if mark is None:
                del marks[k]
            else:
                marks[k] = mark
            if write and mask:
                state.blocks[k] = mask
            below = children.get(k)
            if below is not None:
                if stack is None:
                    stack = []
                if isinstance(below, list):
                    stack.extend(below)
                else:
                    stack.append(below)
        elif k is key and write and mask:
            state.blocks[k] = mask  # (its mask changed: written with the mark it has)
        if not stack:
            return
        k = stack.pop()


class EventReader:
    """Every gateway's side: a chain's match per domain, from the shared index, in one round
    trip (the epochs read in the same pipeline as the lookup; see the module docstring)."""

    def __init__(self, client: AnyRedis) -> None:
        self.client = client
        self.cluster = isinstance(client, RedisCluster)
        self.epochs: dict[str, int] = {}
        """domain id -> its epoch, for the domains whose events flow (someone wrote them)."""
        self.names: dict[str, str] = {}
        self.on_wipe: Callable[[str], None] | None = None
        """Called with a domain's name when its epoch is seen to move (a wipe or a restart
        its owner wrote): the caller drops what it keeps of the domain (speculative entries)."""
        self.retries = 0
        self.speculated = 0
        """Speculative entries written (blocks)."""
        self.speculate_failures = 0
        """Speculative writes that failed, or were not sent (`MAX_SPECULATING` in flight)."""
        self._lookup = client.register_script(LOOKUP)
        self.lane: LookupLane | NodeLanes = (
            NodeLanes(client, LOOKUP, self._lookup.sha)
            if isinstance(client, RedisCluster)
            else LookupLane(client, LOOKUP, self._lookup.sha)
        )
        """Lookups go down their own connection (a cluster: one per master), the deadline on
        Redis's time: on one Redis one script call each (the epochs read in it); in a cluster
        the script on the chain's master and the epochs on theirs, side by side."""
        self._speculate = client.register_script(SPECULATE)
        self._arg = b""
        self._speculating: set[asyncio.Task[None]] = set()

    def live(self, domain: str) -> bool:
        return replica_id(domain) in self.epochs

    async def refresh(self) -> None:
        self._epochs_read(await self.client.hgetall(DOMAINS_KEY))

    def take_epochs(self, raw: dict[Any, Any]) -> None:
        """The domains hash as read elsewhere (`cachemap.redis.frontiers`' rounds)."""
        self._epochs_read(raw)

    def _epochs_read(self, raw: dict[Any, Any]) -> bool:
        """Take the epochs Redis holds; True when they differ from those the lookup used."""
        epochs: dict[str, int] = {}
        for rid, value in raw.items():
            epoch, _, name = text(value).partition("|")
            epochs[text(rid)] = int(epoch)
            self.names[text(rid)] = name
        if epochs == self.epochs:
            return False
        if self.on_wipe is not None:
            for rid, now in epochs.items():
                if rid in self.epochs and self.epochs[rid] != now:
                    self.on_wipe(self.names[rid])
        self.epochs = epochs
        self._arg = "".join(f"{rid},{e};" for rid, e in epochs.items()).encode()
        return True

    async def lookup(
        self, hashes: Sequence[BlockHash], deadline_s: float | None = None
    ) -> dict[str, Match]:
        """domain -> its match of the chain (domains matching nothing are absent). Past
        `deadline_s` it raises a `TimeoutError`: on one Redis that is Redis's time (the lookups'
        own connection, `cachemap.redis.lookups`: a reply that arrived while this process's
        loop ran other work is not late); in a cluster each of its two calls' (`_on_nodes`)."""
        if not hashes:
            return {}
        keys, head = chain_call(hashes)
        if isinstance(self.lane, NodeLanes):
            self.lane.ride()  # the lane's rider, beside the lookup (`NodeLanes.ride`)
            flat = await self._on_nodes(self.lane, keys, head, deadline_s)
        else:
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            self.lane.send([([keys[0], DOMAINS_KEY], [*head, self._arg], deadline_s, future)])
            changed, raw, flat = await future
            if changed:  # answered on the epochs Redis holds: this view catches up
                self._epochs_read(dict(zip(raw[::2], raw[1::2], strict=True)))
        out: dict[str, Match] = {}
        for i in range(0, len(flat), 4):
            name = self.names.get(text(flat[i]))
            if name is not None:
                out[name] = Match(int(flat[i + 1]), int(flat[i + 2]), int(flat[i + 3]))
        return out

    async def _on_nodes(
        self, lanes: NodeLanes, keys: list[bytes], head: list[bytes], deadline_s: float | None
    ) -> Any:
        """A cluster's lookup: the domains hash (another slot) read beside the chain's script,
        each down its master's lane with the deadline on Redis's time (a wall-clock `wait_for`
        around redis-py's pipeline counted this loop's lag against Redis); looked up again when
        the epochs moved since this view's. A lane loads a script its master lost."""
        for attempt in range(3):
            epochs = lanes.command(DOMAINS_KEY, ("HGETALL", DOMAINS_KEY), "", deadline_s)
            script = lanes.command(
                keys[0],
                ("EVALSHA", self._lookup.sha, 1, keys[0], *head, self._arg),
                LOOKUP,
                deadline_s,
            )
            answers: tuple[Any, Any] = await asyncio.gather(epochs, script, return_exceptions=True)
            for answer in answers:
                if isinstance(answer, BaseException):
                    raise answer
            raw, reply = answers
            if isinstance(raw, list):  # a map as a flat list (RESP2)
                raw = dict(zip(raw[::2], raw[1::2], strict=True))
            if self._epochs_read(raw) and attempt < 2:  # a wipe or a new domain since
                self.retries += 1
                continue
            return reply[2]
        raise AssertionError("unreachable: the last attempt returns or raises")

    def speculate(self, domain: str, hashes: Sequence[BlockHash], ttl_s: float) -> bool:
        """Share a placement's speculative entry (`hashes`: one chain's blocks, as placed),
        written in the background: the request does not wait for it. False when not sent (the
        domain's events do not flow, nothing to write, or too many writes in flight)."""
        rid = replica_id(domain)
        epoch = self.epochs.get(rid)
        if epoch is None or not hashes:
            return False
        if len(self._speculating) >= MAX_SPECULATING:
            self.speculate_failures += 1
            return False
        task = asyncio.get_running_loop().create_task(
            self._write_speculative(rid, epoch, hashes, max(int(ttl_s * 1000), 1))
        )
        self._speculating.add(task)
        task.add_done_callback(self._speculating.discard)
        return True

    async def _write_speculative(
        self, rid: str, epoch: int, hashes: Sequence[BlockHash], ttl_ms: int
    ) -> None:
        """Calls of `SPECULATE_CHUNK` blocks, `SPECULATE_ROUND` of them a pipeline, each
        pipeline awaited before the next: a lookup waits behind one pipeline at most, not
        behind the whole chain."""
        written = 0
        sha = self._speculate.sha
        step = SPECULATE_CHUNK * SPECULATE_ROUND
        try:
            for start in range(0, len(hashes), step):
                part = hashes[start : start + step]
                for attempt in range(2):
                    pipe = self.client.pipeline() if self.cluster else self.client.pipeline(False)
                    for at in range(0, len(part), SPECULATE_CHUNK):
                        keys, head = chain_call(part[at : at + SPECULATE_CHUNK])
                        pipe.execute_command("EVALSHA", sha, 1, keys[0], *head, rid, epoch, ttl_ms)
                    replies = await pipe.execute(raise_on_error=False)
                    errors = [r for r in replies if isinstance(r, Exception)]
                    if not errors:
                        break
                    if attempt or not all(isinstance(e, NoScriptError) for e in errors):
                        raise errors[0]
                    await self.client.script_load(SPECULATE)  # (each call sets what it sets)
                written += len(part)
        except Exception as exc:  # Redis away or slow: this placement is known here only
            self.speculate_failures += 1
            self.speculated += written
            log.debug("shared speculative entry not written: %r", exc)
            return
        self.speculated += written

    async def settle(self) -> None:
        """Wait for the speculative writes in flight (each is bounded by the client's timeout)."""
        await asyncio.gather(*self._speculating, return_exceptions=True)

    async def close(self) -> None:
        """Settle, then close the lookups' connection."""
        await self.settle()
        await self.lane.close()


class Leases:
    """One owner per domain: a key set if absent with an expiry, renewed by its holder; a dead
    holder's lease expires and another gateway takes the domain. Each gateway also marks itself
    live for a lease with the number of domains it owns (`heartbeat`), so owners can balance."""

    def __init__(self, client: AnyRedis, owner: str, lease_s: float) -> None:
        self.client = client
        self.owner = owner
        self.lease_ms = max(int(lease_s * 1000), 1)
        self._renew = client.register_script(RENEW)
        self._release = client.register_script(RELEASE)
        self._gateways = client.register_script(GATEWAYS)

    async def heartbeat(self, owned: int) -> list[int]:
        """Mark this gateway live (one lease) owning `owned` domains; the owned counts of every
        live gateway, this one's first."""
        counts = await self._gateways(keys=[GATEWAYS_KEY], args=[self.owner, self.lease_ms, owned])
        return [int(c) for c in counts]

    async def leave(self) -> None:
        """A graceful stop: the others balance without waiting for this gateway's mark to end."""
        await self.client.hdel(GATEWAYS_KEY, self.owner)

    async def acquire(self, domain: str) -> bool:
        key = lease_key(replica_id(domain))
        return bool(await self.client.set(key, self.owner, nx=True, px=self.lease_ms))

    async def renew(self, domain: str) -> bool:
        key = lease_key(replica_id(domain))
        return bool(await self._renew(keys=[key], args=[self.owner, self.lease_ms]))

    async def release(self, domain: str) -> None:
        await self._release(keys=[lease_key(replica_id(domain))], args=[self.owner])

    async def holder(self, domain: str) -> str | None:
        value = await self.client.get(lease_key(replica_id(domain)))
        return None if value is None else text(value)
