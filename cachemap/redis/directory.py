"""The Redis directory: the same protocol as the in-process one, shared by every gateway.

The key schema is in `cachemap.redis.schema`, the scripts in `cachemap.redis.scripts`.

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

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError

from cachemap.directory import DEFAULT_REPLICA_CAPACITY_BLOCKS, DEFAULT_TTL_S
from cachemap.keys import BlockHash
from cachemap.redis import scripts
from cachemap.redis.client import AnyRedis, stop_task
from cachemap.redis.schema import (
    CHANNEL,
    COUNT_KEY,
    FLOOR_KEY,
    GEN_KEY,
    START_KEY,
    chain_call,
    replica_id,
    text,
)
from cachemap.redis.stores import MarkerStore, RateStore

log = logging.getLogger(__name__)

Clock = Callable[[], float]

GEN_REFRESH_S = 1.0
"""Safety net behind the channel: a gateway that missed a message is stale for at most 1 s."""
MAX_PIPELINED_LOOKUPS = 8
"""Lookups per pipelined write: a burst is cut into several pipelines on several connections,
so the client reads one pipeline's answers while Redis runs the next one's scripts."""


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
        self._lookup = client.register_script(scripts.LOOKUP)
        self.batch_lookups = True
        """Pipeline the lookups of one event-loop tick (in a cluster, redis-py's pipeline sends
        each node its own; its `evalsha` helper is blocked there, the raw command is not)."""
        self._batch: list[tuple[list[bytes], list[Any], asyncio.Future[Any]]] = []
        self._sending: set[asyncio.Task[None]] = set()
        self._record = client.register_script(scripts.RECORD)
        self._drop = client.register_script(scripts.DROP)
        self._count = client.register_script(scripts.COUNT)
        self._bump = client.register_script(scripts.BUMP)
        self._expire = client.register_script(scripts.EXPIRE)
        self.hot = RateStore(client)
        self.markers = MarkerStore(client)
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
            name = names.get(text(flat[i]))
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
            result.writer_depth, result.writer = int(writer[0]), text(writer[1])
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
                await self.client.script_load(scripts.LOOKUP)  # on every primary of a cluster
                continue
            return list(results)
        return list(results)

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
        new_gens = {text(k): int(v) for k, v in gens.items()}
        new_floors = {text(k): int(v) for k, v in floors.items()}
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
                            self._apply(text(message["data"]))
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
