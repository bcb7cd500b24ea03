"""What the Redis directory keeps per replica beside its entries — generations, floors, start
markers — as Redis holds it (`kvg:{kvg-meta}:*`, one slot) and as one gateway remembers it.

Invariants:
- A replica's generation and floor only ever rise, in memory and in Redis, whatever Redis
  forgets: every script that moves a generation takes the caller's own view as a lower bound,
  and a refresh writes back what memory holds above Redis (`reseed`).
- A replica without a `gen` field has the generation base (the highest generation any pruned
  replica reached), so pruning never sends a generation back.
- Redis losing its state (a restart without persistence, a flush, a failover that lost the
  meta slot) is noticed as a changed layout incarnation: the gateway writes back what it knows
  and reports the reset (`RedisDirectory.on_reset`), so its local index can be written back too.
- A layout this code does not know (`schema.KNOWN_LAYOUTS`) is refused: `DirectoryLayoutError`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from cachemap.redis import scripts
from cachemap.redis.client import AnyRedis
from cachemap.redis.schema import (
    BASE_KEY,
    CHANNEL,
    COUNT_KEY,
    FLOOR_KEY,
    GEN_KEY,
    KNOWN_LAYOUTS,
    LAYOUT,
    LAYOUT_KEY,
    LIVE_KEY,
    SEEN_KEY,
    START_KEY,
    text,
)

RESTART_EPOCH = 2
"""A restart (`forget`, a new start marker) advances a replica's generation by this much."""


class DirectoryLayoutError(RuntimeError):
    """The shared directory holds a layout this gateway does not know: it must not use it."""


class ReplicaMeta:
    def __init__(self, client: AnyRedis) -> None:
        self.client = client
        self.gens: dict[str, int] = {}
        self.floors: dict[str, int] = {}
        self.base = 0
        self.live: dict[str, tuple[int, int]] = {}
        """rid -> (generation, the oldest live generation at it): `oldest`."""
        self.starts: dict[str, str] = {}
        """rid -> the start marker this gateway last reported (written back after a reset)."""
        self.incarnation: str | None = None
        """The layout incarnation last seen: None until the first refresh."""
        self.version = 0
        """Bumped on every change of a generation, a floor or the base (callers cache on it)."""
        self.on_change: Callable[[], None] | None = None
        self.on_epoch: Callable[[str], None] | None = None
        """Called with a replica's id when its generation rose by a restart epoch (2) or more
        at once: a restart some gateway reported (a capacity advance moves it by 1)."""
        self._count = client.register_script(scripts.COUNT)
        self._bump = client.register_script(scripts.BUMP)
        self._expire = client.register_script(scripts.EXPIRE)
        self._meta = client.register_script(scripts.META)
        self._reseed = client.register_script(scripts.RESEED)
        self._prune = client.register_script(scripts.PRUNE)

    def gen(self, rid: str) -> int:
        return self.gens.get(rid, self.base)

    def floor(self, rid: str) -> int:
        return self.floors.get(rid, -1)

    def oldest(self, rid: str) -> int:
        """The oldest generation whose entries match: the live generations' (the counts in
        `kvg:{kvg-meta}:live`) when they are of the replica's current generation, else the
        generation before (two generations: what a gateway of the commit before matches)."""
        gen = self.gen(rid)
        live = self.live.get(rid)
        if live is not None and live[0] == gen:
            return live[1]
        return gen - 1

    # -- the scripts -----------------------------------------------------------------------------
    async def count(
        self,
        rid: str,
        num_new: int,
        moved: dict[int, int],
        written: int,
        sizes: tuple[int, int],
        now_ms: int,
    ) -> None:
        """`num_new` blocks written at generation `written`, `moved` from other generations
        (generation -> blocks); `sizes`: (blocks per generation, the replica's capacity)."""
        per_generation, capacity = sizes
        gen, oldest = await self._count(
            keys=[GEN_KEY, COUNT_KEY, SEEN_KEY, BASE_KEY, LIVE_KEY],
            args=[
                rid,
                num_new,
                per_generation,
                CHANNEL,
                self.gen(rid),
                now_ms,
                written,
                "".join(f"{g},{n};" for g, n in moved.items()),
                capacity,
            ],
        )
        self.set_gen(rid, int(gen))
        self.set_live(rid, int(gen), int(oldest))

    async def bump(self, rid: str, marker: str, previous: str, now_ms: int) -> bool:
        """Report a start marker ('' = bump unconditionally); True when that is a restart."""
        gen, bumped = await self._bump(
            keys=[GEN_KEY, COUNT_KEY, START_KEY, SEEN_KEY, BASE_KEY, LIVE_KEY],
            args=[rid, marker, CHANNEL, self.gen(rid), previous, now_ms],
        )
        self.set_gen(rid, int(gen))
        if bumped:  # nothing older than the new generation is live (`scripts.BUMP`)
            self.set_live(rid, int(gen), int(gen))
        if marker:
            self.starts[rid] = marker
        return bool(bumped)

    async def expire(self, rid: str, before_ms: int) -> None:
        floor = await self._expire(keys=[FLOOR_KEY], args=[rid, before_ms, CHANNEL])
        self.set_floor(rid, int(floor))

    async def prune(self, now_ms: int, horizon_ms: int) -> int:
        """Drop replicas quiet for `horizon_ms` from every meta hash; how many went."""
        pruned, base = await self._prune(
            keys=[GEN_KEY, COUNT_KEY, START_KEY, FLOOR_KEY, SEEN_KEY, BASE_KEY, LIVE_KEY],
            args=[now_ms, horizon_ms],
        )
        self._set_base(int(base))
        return int(pruned)

    async def refresh(self) -> bool:
        """Reload every replica's generation and floor; True when Redis lost its state since
        this gateway last looked (or this is the first look), after writing back what this
        gateway knows."""
        layout, gens, floors, base, live = await self._meta(
            keys=[LAYOUT_KEY, GEN_KEY, FLOOR_KEY, BASE_KEY, LIVE_KEY], args=[]
        )
        stored_gens, stored_floors = _pairs(gens), _pairs(floors)
        self._set_base(int(base))
        for i in range(0, len(live), 2):
            gen, oldest = text(live[i + 1]).split(",")
            self.set_live(text(live[i]), int(gen), int(oldest))
        version, incarnation = _layout(layout)
        _check(version)  # before writing anything into a layout we do not know
        if incarnation is None or incarnation != self.incarnation:
            # a Redis without our layout (new, emptied, or written by layout 1), or another
            # incarnation than we knew: merge both ways, then keep what Redis says
            self._merge(stored_gens, stored_floors, keep_absent=True)
            await self.reseed()
            return True
        higher = any(v > stored_gens.get(rid, v) for rid, v in self.gens.items()) or any(
            v > stored_floors.get(rid, v) for rid, v in self.floors.items()
        )
        self._merge(stored_gens, stored_floors, keep_absent=False)
        if higher:  # Redis lost some writes (a failover): write back
            await self.reseed()
        return False

    async def reseed(self) -> None:
        """Write back this gateway's generations, floors, base and start markers (values only
        rise), creating the layout if it is missing; adopts the stored incarnation."""
        layout = await self._reseed(
            keys=[LAYOUT_KEY, GEN_KEY, FLOOR_KEY, BASE_KEY, START_KEY],
            args=[
                LAYOUT,
                uuid.uuid4().hex,
                self.base,
                "".join(f"{rid},{g};" for rid, g in self.gens.items()),
                "".join(f"{rid},{f};" for rid, f in self.floors.items()),
                "".join(f"{rid},{m};" for rid, m in self.starts.items()),
            ],
        )
        version, incarnation = _layout(layout)
        _check(version)
        self.incarnation = incarnation

    # -- memory ----------------------------------------------------------------------------------
    def apply(self, message: str) -> None:
        """A channel message: "rid:gen", "rid:live:oldest:gen" or "rid:floor:ms"; values only
        ever rise."""
        parts = message.split(":")
        if len(parts) == 2:
            self.set_gen(parts[0], int(parts[1]))
        elif len(parts) == 4 and parts[1] == "live":
            self.set_live(parts[0], int(parts[3]), int(parts[2]))
        elif len(parts) == 3 and parts[1] == "floor":
            self.set_floor(parts[0], int(parts[2]))

    def set_gen(self, rid: str, gen: int) -> None:
        before = self.gen(rid)
        if gen > before:
            self.gens[rid] = gen
            self._changed()
            self._epoch(rid, before, gen)

    def set_live(self, rid: str, gen: int, oldest: int) -> None:
        """The replica's oldest live generation at generation `gen` (both only rise)."""
        if (gen, oldest) > self.live.get(rid, (-1, -1)):
            self.live[rid] = (gen, oldest)
            self._changed()

    def _epoch(self, rid: str, before: int, gen: int) -> None:
        if gen - before >= RESTART_EPOCH and self.on_epoch is not None:
            self.on_epoch(rid)

    def set_floor(self, rid: str, floor_ms: int) -> None:
        if floor_ms > self.floor(rid):
            self.floors[rid] = floor_ms
            self._changed()

    def forget_replica(self, rid: str) -> None:
        """This gateway no longer routes to the replica: drop what only reseeding needed."""
        self.starts.pop(rid, None)

    def _set_base(self, base: int) -> None:
        if base > self.base:
            self.base = base
            self._changed()

    def _merge(self, gens: dict[str, int], floors: dict[str, int], *, keep_absent: bool) -> None:
        """Take the higher of memory and Redis for every replica Redis has; a replica Redis
        does not have was pruned (dropped here too) unless `keep_absent` (Redis lost it)."""
        for rid, v in gens.items():
            if rid in self.gens:
                self._epoch(rid, self.gens[rid], v)
        for mine, stored in ((self.gens, gens), (self.floors, floors)):
            merged = {rid: max(v, mine.get(rid, v)) for rid, v in stored.items()}
            if keep_absent:
                merged = {**mine, **merged}
            if merged != mine:
                mine.clear()
                mine.update(merged)
                self._changed()
        for rid in [rid for rid in self.live if rid not in self.gens]:
            del self.live[rid]  # pruned: its live generations went with it

    def _changed(self) -> None:
        self.version += 1
        if self.on_change is not None:
            self.on_change()


def _pairs(flat: Any) -> dict[str, int]:
    """A Lua HGETALL (a flat list) or a RESP3 map, as {field: int}."""
    if isinstance(flat, dict):
        return {text(k): int(v) for k, v in flat.items()}
    return {text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}


def _layout(value: Any) -> tuple[int | None, str | None]:
    version, incarnation = [*list(value or ()), None, None][:2]
    return (
        int(version) if version is not None else None,
        text(incarnation) if incarnation is not None else None,
    )


def _check(version: int | None) -> None:
    if version is not None and version not in KNOWN_LAYOUTS:
        raise DirectoryLayoutError(
            f"the shared directory in Redis has layout {version}; this gateway knows layouts "
            f"{', '.join(map(str, KNOWN_LAYOUTS))}: upgrade it, or give it another Redis"
        )
