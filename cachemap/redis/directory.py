"""The Redis directory: the same protocol as the in-process one, shared by every gateway.

Key schema (all binary-safe; `{...}` is the Redis Cluster hash tag):

    kvg:{TAG}:<16-byte block hash>   HASH  replica id -> "<generation>:<last use, ms>"
                                     PEXPIRE = ttl, refreshed on every record
    kvg:{kvg-meta}:gen               HASH  replica id -> current generation
    kvg:{kvg-meta}:count             HASH  replica id -> blocks recorded in this generation
    kvg:{kvg-meta}:start             HASH  replica id -> the engine's last seen start marker
    kvg:{kvg-meta}:floor             HASH  replica id -> entries last used at or before this
                                           (ms) no longer match (reconciliation's `expire`)
    channel kvg:gen                  "<replica id>:<generation>" on every generation change

TAG is the hex of the 6-byte tag every block hash of a chain starts with (`cachemap.keys`: the
salted block 0's first bytes), so every key of one chain sits in one cluster slot — a lookup is
ONE script call whatever the chain length, and any slice of a chain is addressed by itself —
while tenants and system prompts spread over the shards.
A replica id is the 32-bit MurmurHash3 of the replica's name, in hex: every gateway derives the
same id without coordination.

Generations do three jobs with one number per replica:
- An entry matches only if its generation is the replica's current one or the one before.
- Capacity: after `capacity_blocks / 2` blocks are recorded on a replica its generation
  advances, so at most `capacity_blocks` entries (two generations' worth) match — an LRU
  approximation in which a recorded (used) block is rewritten at the current generation.
- Restart epochs: `forget()` (and a new engine start marker) advances it by 2, so every old
  entry stops matching at once: an epoch bump, never a scan. Stale fields die with their keys'
  TTL.
Gateways keep the current generations and floors in memory (refreshed by the channel and every
`GEN_REFRESH_S`) and pass them to the lookup script, which also applies the TTL to each entry's
last use, so an entry refreshed by one replica does not keep another's alive.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import mmh3
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import NoScriptError
from redis.retry import Retry

from cachemap.directory import DEFAULT_REPLICA_CAPACITY_BLOCKS, DEFAULT_TTL_S
from cachemap.keys import TAG_BYTES, BlockHash

SUFFIX_BYTES = 16 - TAG_BYTES
"""What follows the tag in a block hash: a block's key is the chain's prefix + these bytes."""

log = logging.getLogger(__name__)

Clock = Callable[[], float]
AnyRedis = aioredis.Redis | RedisCluster

GEN_KEY = b"kvg:{kvg-meta}:gen"
COUNT_KEY = b"kvg:{kvg-meta}:count"
START_KEY = b"kvg:{kvg-meta}:start"
FLOOR_KEY = b"kvg:{kvg-meta}:floor"
CHANNEL = "kvg:gen"
LAND_CHANNEL = "kvg:land"
"""Fan-out leaders announce here that their write landed: "<marker>|<replica>|ok|fail"."""
GEN_REFRESH_S = 1.0
MAX_PIPELINED_LOOKUPS = 8
"""Lookups per pipelined write: a burst is cut into several pipelines on several connections,
so the client reads one pipeline's answers while Redis runs the next one's scripts."""
"""Safety net behind the channel: a gateway that missed a message is stale for at most 1 s."""

# The chain scripts declare the chain's first key (it routes the call to the slot every key of
# the chain shares) and take the blocks as one blob of 10-byte suffixes: packing one argument
# instead of one key per block halved the client's CPU per lookup (see docs/design/directory.md).
_CHAIN = """
-- ARGV[1]: the chain's key prefix "kvg:{TAG}:", ARGV[2]: the blocks' 10-byte suffixes, joined
local prefix, blob = ARGV[1], ARGV[2]
local KEYS = {}
for i = 1, #blob / 10 do KEYS[i] = prefix .. string.sub(blob, i * 10 - 9, i * 10) end
"""

# ARGV (after the chain): now ms, ttl ms, rate window ms (0: do not count), find writers (0/1),
# and the replicas' "rid,oldest live gen,floor ms;" entries in one string.
# Returns {{rid, depth, last use}*, {depth, rate, k} | {}, {shared depth, writer} | {}}.
_LOOKUP = (
    _CHAIN
    + """
local now = tonumber(ARGV[3])
local ttl = tonumber(ARGV[4])
local window_ms = tonumber(ARGV[5])
local mingen = {}
local floor = {}
for rid, gen, fl in string.gmatch(ARGV[7], '([^,;]+),([^,;]+),([^,;]+);') do
  mingen[rid] = tonumber(gen)
  floor[rid] = tonumber(fl)
end
local depth = {}
local last = {}
local deepest = 0
-- one record call writes the same "<generation>:<last use>" to every block of its chain, so a
-- value is parsed once per lookup (Lua interns strings: the memo is a pointer lookup)
local gens, useds = {}, {}
for i = 1, #KEYS do
  local fields = redis.call('HGETALL', KEYS[i])
  local advanced = false
  for j = 1, #fields, 2 do
    local rid = fields[j]
    if (depth[rid] or 0) == i - 1 then
      local value = fields[j + 1]
      local gen, used = gens[value], useds[value]
      if not gen then
        local sep = string.find(value, ':', 1, true)
        gen = tonumber(string.sub(value, 1, sep - 1))
        used = tonumber(string.sub(value, sep + 1))
        gens[value], useds[value] = gen, used
      end
      if gen >= (mingen[rid] or 0) and now - used < ttl and used > (floor[rid] or -1) then
        depth[rid] = i
        last[rid] = used
        advanced = true
      end
    end
  end
  if not advanced then break end
  deepest = i
end
local out = {}
for rid, d in pairs(depth) do
  out[#out + 1] = rid
  out[#out + 1] = d
  out[#out + 1] = last[rid]
end
local hot = {}
if window_ms > 0 and deepest > 0 then
  local key = KEYS[deepest] .. ':r'
  local v = redis.call('HMGET', key, 'w', 'c', 'p', 'k')
  local window = math.floor(now / window_ms)
  local w, c, p = tonumber(v[1]) or window, tonumber(v[2]) or 0, tonumber(v[3]) or 0
  local k = tonumber(v[4]) or 1
  if w ~= window then
    if w == window - 1 then p = c else p = 0 end
    c = 0
  end
  c = c + 1
  redis.call('HSET', key, 'w', window, 'c', c, 'p', p)
  redis.call('PEXPIRE', key, 2 * window_ms)
  local rate = (p * math.max(0, 1 - (now / window_ms - window)) + c) * 60000 / window_ms
  hot = {deepest, tostring(rate), k}
end
local writer = {}
if ARGV[6] == '1' then
  for i = deepest + 1, #KEYS do
    local w = redis.call('GET', KEYS[i] .. ':w')
    if not w then break end
    writer = {i, w}
  end
end
return {out, hot, writer}
"""
)

# KEYS: a prefix's rate key. ARGV: k.
_SET_K = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'k', ARGV[1]) end
return 1
"""

# ARGV (after the chain): the leader's marker, ttl ms. A block's marker is its key + ":w";
# the first writer wins.
_LEAD = (
    _CHAIN
    + """
local n = 0
for i = 1, #KEYS do
  if redis.call('SET', KEYS[i] .. ':w', ARGV[3], 'NX', 'PX', ARGV[4]) then n = n + 1 end
end
return n
"""
)

# ARGV (after the chain): the leader's pending marker, its landed marker, ttl ms, channel.
_LAND = (
    _CHAIN
    + """
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i] .. ':w') == ARGV[3] then
    redis.call('SET', KEYS[i] .. ':w', ARGV[4], 'PX', ARGV[5])
  end
end
redis.call('PUBLISH', ARGV[6], ARGV[4])
return 1
"""
)

# ARGV (after the chain): rid, generation, now ms, ttl ms.
_RECORD = (
    _CHAIN
    + """
local value = ARGV[4] .. ':' .. ARGV[5]
for i = 1, #KEYS do
  redis.call('HSET', KEYS[i], ARGV[3], value)
  redis.call('PEXPIRE', KEYS[i], ARGV[6])
end
return #KEYS
"""
)

# ARGV (after the chain): rid.
_DROP = (
    _CHAIN
    + """
for i = 1, #KEYS do redis.call('HDEL', KEYS[i], ARGV[3]) end
return #KEYS
"""
)

# KEYS: gen, count. ARGV: rid, blocks recorded, blocks per generation
_COUNT = """
local n = redis.call('HINCRBY', KEYS[2], ARGV[1], ARGV[2])
local gen = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if n >= tonumber(ARGV[3]) then
  gen = redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
  redis.call('HSET', KEYS[2], ARGV[1], 0)
  redis.call('PUBLISH', ARGV[4], ARGV[1] .. ':' .. gen)
end
return gen
"""

# KEYS: floor. ARGV: rid, ms, channel. Floors only rise.
_EXPIRE = """
local old = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1')
if tonumber(ARGV[2]) > old then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('PUBLISH', ARGV[3], ARGV[1] .. ':floor:' .. ARGV[2])
  return tonumber(ARGV[2])
end
return old
"""

# KEYS: gen, count, start. ARGV: rid, start marker ('' = unconditional), channel
_BUMP = """
if ARGV[2] ~= '' then
  local old = redis.call('HGET', KEYS[3], ARGV[1])
  redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
  if (not old) or old == ARGV[2] then
    return {tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0'), 0}
  end
end
local gen = redis.call('HINCRBY', KEYS[1], ARGV[1], 2)
redis.call('HSET', KEYS[2], ARGV[1], 0)
redis.call('PUBLISH', ARGV[3], ARGV[1] .. ':' .. gen)
return {gen, 1}
"""


async def stop_task(task: asyncio.Task[Any], grace_s: float) -> None:
    """Cancel a background task and wait for it, at most `grace_s`. A pub/sub read inside
    redis-py has been seen to swallow the cancellation (a teardown hung on it), so loops also
    check a closing flag, and a close never waits on them unbounded."""
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=grace_s)
    if not done:
        log.warning("a background task did not stop within %.1f s: %r", grace_s, task)
    elif not task.cancelled() and task.exception() is not None:
        log.debug("background task ended with %r", task.exception())


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def replica_id(replica: str) -> str:
    return format(mmh3.hash(replica, signed=False), "08x")


def chain_call(hashes: Sequence[BlockHash]) -> tuple[list[bytes], list[bytes]]:
    """(keys, leading args) of a chain script: the first block's key (for the slot), then the
    key prefix and the blocks' suffixes joined (see `_CHAIN`)."""
    prefix = b"kvg:{" + hashes[0][:TAG_BYTES].hex().encode() + b"}:"
    blob = b"".join([h[TAG_BYTES:] for h in hashes])
    assert len(blob) == len(hashes) * SUFFIX_BYTES, "block hashes are 16 bytes"
    return [prefix + hashes[0][TAG_BYTES:]], [prefix, blob]


def block_keys(hashes: Sequence[BlockHash]) -> list[bytes]:
    """The Redis key of each block: its chain's tag in braces, then the rest of the hash."""
    if not hashes:
        return []
    prefix = b"kvg:{" + hashes[0][:TAG_BYTES].hex().encode() + b"}:"
    assert all(h[:TAG_BYTES] == hashes[0][:TAG_BYTES] for h in hashes[-1:]), "one chain per call"
    return [prefix + h[TAG_BYTES:] for h in hashes]


async def open_redis(url: str, *, cluster: bool | None = None, timeout_s: float = 1.0) -> AnyRedis:
    """One client for `redis://`, `rediss://` or `unix://` URLs; a Redis Cluster when
    `cluster` is True, or when None and the server says `cluster_enabled:1`.

    Retries only connection errors and timeouts (3 times, exponential backoff with jitter);
    every write kvgate makes is idempotent, so a replayed one does no harm.
    """
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(ExponentialWithJitterBackoff(), 3),
    }
    if cluster is None:
        probe = aioredis.Redis.from_url(url, **options)
        try:
            info = await probe.info("cluster")
            cluster = bool(info.get("cluster_enabled"))
        finally:
            await probe.aclose()
    if cluster:
        if url.startswith("unix://"):
            raise ValueError("a Redis Cluster is reached over TCP (redis:// or rediss://)")
        return RedisCluster.from_url(url, **options)
    return aioredis.Redis.from_url(url, **options)


@dataclass
class SharedLookup:
    detail: dict[str, tuple[int, float]]
    hot_depth: int = 0
    rate_per_min: float = 0.0
    k: int = 1
    writer_depth: int = 0
    writer: str | None = None


class RedisDirectory:
    """The `Directory` protocol on Redis or Redis Cluster (see the module docstring)."""

    def __init__(
        self,
        client: AnyRedis,
        *,
        capacity_blocks: int = DEFAULT_REPLICA_CAPACITY_BLOCKS,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Clock = time.time,
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
        self._lookup = client.register_script(_LOOKUP)
        self.batch_lookups = True
        """Pipeline the lookups of one event-loop tick (in a cluster, redis-py's pipeline sends
        each node its own; its `evalsha` helper is blocked there, the raw command is not)."""
        self._batch: list[tuple[list[bytes], list[Any], asyncio.Future[Any]]] = []
        self._sending: set[asyncio.Task[None]] = set()
        self._record = client.register_script(_RECORD)
        self._drop = client.register_script(_DROP)
        self._count = client.register_script(_COUNT)
        self._bump = client.register_script(_BUMP)
        self._expire = client.register_script(_EXPIRE)
        self._set_k = client.register_script(_SET_K)
        self._lead = client.register_script(_LEAD)
        self._land = client.register_script(_LAND)
        self._names: dict[str, str] = {}
        self._gens: dict[str, int] = {}
        self._floors: dict[str, int] = {}
        self._replica_arg: bytes | None = None
        """The lookup's per-replica argument, cached (see `_set_gen`, `_set_floor`)."""
        self._watcher: asyncio.Task[None] | None = None
        self._closing = False

    # -- the protocol ------------------------------------------------------------------------
    async def lookup(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        return {r: d for r, (d, _) in (await self.lookup_detail(hashes)).items()}

    async def lookup_detail(self, hashes: Sequence[BlockHash]) -> dict[str, tuple[int, float]]:
        return (await self.lookup_full(hashes)).detail

    async def lookup_full(
        self, hashes: Sequence[BlockHash], *, rate_window_s: float = 0.0, writers: bool = False
    ) -> SharedLookup:
        """One script call: each replica's depth and last use; with `rate_window_s`, the
        matched prefix's request rate (this request counted) and k; with `writers`, the
        deepest uncached block an in-flight leader is writing and the leader's marker."""
        if not hashes:
            return SharedLookup({})
        if self._replica_arg is None:  # rebuilt only when a generation or a floor changed
            # only the replicas this gateway routes to (lookups report no other): bounded
            self._replica_arg = "".join(
                f"{rid},{self._gens.get(rid, 0) - 1},{self._floors.get(rid, -1)};"
                for rid in self._names
                if rid in self._gens or rid in self._floors
            ).encode()
        args: list[Any] = [
            int(self.clock() * 1000),
            int(self.ttl_s * 1000),
            int(rate_window_s * 1000),
            1 if writers else 0,
            self._replica_arg,
        ]
        keys, head = chain_call(hashes)
        flat, hot, writer = await self._call_lookup(keys, [*head, *args])
        names = self._names
        detail: dict[str, tuple[int, float]] = {}
        for i in range(0, len(flat), 3):
            name = names.get(_text(flat[i]))
            if name is not None:
                detail[name] = (int(flat[i + 1]), int(flat[i + 2]) / 1000)
        result = SharedLookup(detail)
        if hot:
            result.hot_depth, result.rate_per_min, result.k = (
                int(hot[0]),
                float(hot[1]),
                int(hot[2]),
            )
        if writer:
            result.writer_depth, result.writer = int(writer[0]), _text(writer[1])
        return result

    async def _call_lookup(self, keys: list[bytes], args: list[Any]) -> Any:
        """One EVALSHA per lookup; the lookups that arrive in the same event-loop tick share one
        pipelined write and read (each is still its own command and its own answer)."""
        if not self.batch_lookups:
            return await self._lookup(keys=keys, args=args)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        batch = self._batch
        batch.append((keys, args, future))
        if len(batch) == 1:
            asyncio.get_running_loop().call_soon(self._flush_lookups, batch)
        if len(batch) == MAX_PIPELINED_LOOKUPS:
            self._batch = []  # the next lookups start the next pipeline
        return await future

    def _flush_lookups(
        self, batch: list[tuple[list[bytes], list[Any], asyncio.Future[Any]]]
    ) -> None:
        if batch is self._batch:
            self._batch = []
        task = asyncio.create_task(self._send_lookups(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send_lookups(
        self, batch: list[tuple[list[bytes], list[Any], asyncio.Future[Any]]]
    ) -> None:
        live = [item for item in batch if not item[2].done()]  # callers may have given up
        if not live:
            return
        try:
            if len(live) == 1:
                results: list[Any] = [await self._lookup(keys=live[0][0], args=live[0][1])]
            else:
                results = await self._pipelined(live)
        except Exception as exc:  # every waiter hears the error (the caller falls back)
            for _, _, future in live:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, _, future), result in zip(live, results, strict=True):
            if future.done():
                continue
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)

    async def _pipelined(
        self, batch: list[tuple[list[bytes], list[Any], asyncio.Future[Any]]]
    ) -> list[Any]:
        sha = self._lookup.sha
        for attempt in range(2):
            pipe = self.client.pipeline() if self.cluster else self.client.pipeline(False)
            for keys, args, _ in batch:
                pipe.execute_command("EVALSHA", sha, len(keys), *keys, *args)
            results = await pipe.execute(raise_on_error=False)
            if attempt == 0 and any(isinstance(r, NoScriptError) for r in results):
                await self.client.script_load(_LOOKUP)  # on every primary of a cluster
                continue
            return list(results)
        return list(results)

    async def set_k(self, prefix: BlockHash, k: int) -> None:
        await self._set_k(keys=[block_keys([prefix])[0] + b":r"], args=[k])

    async def lead(self, blocks: Sequence[BlockHash], marker: str, ttl_s: float) -> int:
        """Mark `blocks` as being written by a leader (set if absent); how many it now holds."""
        if not blocks:
            return 0
        keys, head = chain_call(blocks)
        return int(await self._lead(keys=keys, args=[*head, marker, int(ttl_s * 1000)]))

    async def land(
        self, blocks: Sequence[BlockHash], marker: str, landed: str, ttl_s: float
    ) -> None:
        """The leader's write landed (or failed): its markers say so for `ttl_s`, and every
        gateway hears it on `LAND_CHANNEL`."""
        if not blocks:
            return
        keys, head = chain_call(blocks)
        await self._land(keys=keys, args=[*head, marker, landed, int(ttl_s * 1000), LAND_CHANNEL])

    async def read_marker(self, block: BlockHash) -> str | None:
        value = await self.client.get(block_keys([block])[0] + b":w")
        return None if value is None else _text(value)

    async def record(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        await self.record_many([(replica, hashes)])

    async def record_many(self, items: Iterable[tuple[str, Sequence[BlockHash]]]) -> None:
        """Several records at once: one script call per chain, then one count per replica."""
        now_ms = int(self.clock() * 1000)
        ttl_ms = int(self.ttl_s * 1000)
        counts: dict[str, int] = {}
        calls = []
        for replica, hashes in items:
            if not hashes:
                continue
            rid = self._rid(replica)
            gen = self._gens.get(rid, 0)
            keys, head = chain_call(hashes)
            calls.append(self._record(keys=keys, args=[*head, rid, gen, now_ms, ttl_ms]))
            counts[rid] = counts.get(rid, 0) + len(hashes)
        if not calls:
            return
        await asyncio.gather(*calls)
        per_generation = max(self.capacity_blocks // 2, 1)
        gens = await asyncio.gather(
            *(
                self._count(keys=[GEN_KEY, COUNT_KEY], args=[rid, n, per_generation, CHANNEL])
                for rid, n in counts.items()
            )
        )
        for rid, gen in zip(counts, gens, strict=True):
            self._set_gen(rid, int(gen))

    async def drop(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        if hashes:
            keys, head = chain_call(hashes)
            await self._drop(keys=keys, args=[*head, self._rid(replica)])

    async def forget(self, replica: str) -> None:
        await self._bump_generation(replica, "")

    async def expire(self, replica: str, before_s: float) -> None:
        rid = self._rid(replica)
        floor = await self._expire(keys=[FLOOR_KEY], args=[rid, int(before_s * 1000), CHANNEL])
        self._set_floor(rid, int(floor))

    async def restarted(self, replica: str, start_marker: str) -> bool:
        """Report the engine's start marker (its start time); a changed marker is a restart and
        bumps the epoch — once, however many gateways report the same restart."""
        return await self._bump_generation(replica, start_marker)

    async def close(self) -> None:
        self._closing = True
        if self._watcher is not None:
            await stop_task(self._watcher, 2 * GEN_REFRESH_S)
        await self.client.aclose()

    # -- generations -------------------------------------------------------------------------
    def register(self, replicas: Iterable[str]) -> None:
        """The replica names this gateway routes to (lookups report only these)."""
        for name in replicas:
            self._rid(name)

    async def refresh_generations(self) -> None:
        """Reload every replica's generation and floor (both live in the meta slot)."""
        gens = await self.client.hgetall(GEN_KEY)
        floors = await self.client.hgetall(FLOOR_KEY)
        new_gens = {_text(k): int(v) for k, v in gens.items()}
        new_floors = {_text(k): int(v) for k, v in floors.items()}
        if new_gens != self._gens or new_floors != self._floors:
            self._gens, self._floors, self._replica_arg = new_gens, new_floors, None

    async def start(self) -> None:
        """Load the generations and keep them fresh (channel + periodic refresh)."""
        await self.refresh_generations()
        self._watcher = asyncio.create_task(self._watch_generations())

    async def _watch_generations(self) -> None:
        while not self._closing:
            try:
                pubsub = self.client.pubsub()
                await pubsub.subscribe(CHANNEL)
                try:
                    while not self._closing:
                        message = await pubsub.get_message(
                            ignore_subscribe_messages=True, timeout=GEN_REFRESH_S
                        )
                        if message is not None:
                            self._apply(_text(message["data"]))
                        else:
                            await self.refresh_generations()
                finally:
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: retry; lookups fall back meanwhile
                log.debug("generation watcher: %s", exc)
                await asyncio.sleep(GEN_REFRESH_S)

    async def _bump_generation(self, replica: str, marker: str) -> bool:
        rid = self._rid(replica)
        gen, bumped = await self._bump(
            keys=[GEN_KEY, COUNT_KEY, START_KEY], args=[rid, marker, CHANNEL]
        )
        self._set_gen(rid, int(gen))
        return bool(bumped)

    def _apply(self, message: str) -> None:
        """A channel message: "rid:gen" or "rid:floor:ms"; values only ever rise."""
        parts = message.split(":")
        if len(parts) == 2:
            self._set_gen(parts[0], int(parts[1]))
        elif len(parts) == 3 and parts[1] == "floor":
            self._set_floor(parts[0], int(parts[2]))

    def _set_gen(self, rid: str, gen: int) -> None:
        """Generations only ever rise."""
        if gen > self._gens.get(rid, 0):
            self._gens[rid] = gen
            self._replica_arg = None

    def _set_floor(self, rid: str, floor_ms: int) -> None:
        """Floors only ever rise."""
        if floor_ms > self._floors.get(rid, -1):
            self._floors[rid] = floor_ms
            self._replica_arg = None

    def _rid(self, replica: str) -> str:
        rid = replica_id(replica)
        if rid not in self._names:
            self._names[rid] = replica
            self._replica_arg = None
        return rid
