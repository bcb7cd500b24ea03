"""The in-process directory: the reference implementation and the default store."""

from __future__ import annotations

import math
import sys
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from cachemap.directory import (
    DEFAULT_REPLICA_CAPACITY_BLOCKS,
    DEFAULT_TTL_S,
    DIRECTORY_CLOCK,
    Clock,
)
from cachemap.keys import BlockHash
from cachemap.native import NATIVE

_REAP_PER_CALL = 1024
"""Entries of forgotten epochs cleaned up per record() call: bounded work on the hot path."""


class Lru(Protocol):
    """One replica's entries in one epoch: block hash -> last use time, least recent first.

    A chain is touched tail first, so block 0 is the most recent of its chain and, on ties, the
    longer chain's tail is evicted first (as vLLM frees blocks). `OrderedLru` is the
    definition; `cachemap._native.Lru` the same in C, where it is built."""

    def __len__(self) -> int: ...
    def get(self, key: BlockHash, default: None = None, /) -> float | None: ...
    def touch_chain(self, hashes: Sequence[BlockHash], now: float) -> None: ...
    def walk(
        self, hashes: Sequence[BlockHash], expired_before: float, first_used: float
    ) -> tuple[int, float]: ...
    def bisect(
        self, hashes: Sequence[BlockHash], expired_before: float, first_used: float
    ) -> tuple[int, float]: ...
    def trim(self, capacity: int, expired_before: float) -> None: ...
    def discard_all(self, hashes: Sequence[BlockHash]) -> None: ...
    def release(self, budget: int) -> int: ...
    def newest_first(self, since_s: float | None = None) -> list[tuple[BlockHash, float]]: ...


class OrderedLru(OrderedDict[BlockHash, float]):
    """`Lru` over an OrderedDict, least recent at the front: the definition."""

    def touch_chain(self, hashes: Sequence[BlockHash], now: float) -> None:
        """Every block used `now`, moved to the newest end tail first."""
        move = self.move_to_end
        for block in reversed(hashes):
            self[block] = now
            move(block)

    def walk(
        self, hashes: Sequence[BlockHash], expired_before: float, first_used: float
    ) -> tuple[int, float]:
        """The leading depth of `hashes` held and used after `expired_before`, and the last use
        of the deepest block matched (`first_used`: the first block's, live)."""
        # the walk over `map` (its `get` calls in C, no slice of `hashes` copied per
        # replica): 40 -> 25 us for the ramp's 325-block prompts
        depth, last = 0, first_used
        for used in map(self.get, hashes):
            if used is None or used <= expired_before:
                break
            depth += 1
            last = used
        return depth, last

    def bisect(
        self, hashes: Sequence[BlockHash], expired_before: float, first_used: float
    ) -> tuple[int, float]:
        """`walk` where the entries are prefix-closed (`MemoryIndex`'s `whole_chains`)."""
        get = self.get
        end = len(hashes)
        used = get(hashes[end - 1])
        if used is not None and used > expired_before:  # the whole prompt: the common case
            return end, used
        # hashes[:held] are held (the deepest used at `last`), hashes[missing] is not
        held, last, missing = 1, first_used, end - 1
        while held < missing:
            mid = (held + missing) // 2
            used = get(hashes[mid])
            if used is not None and used > expired_before:
                held, last = mid + 1, used
            else:
                missing = mid
        return held, last

    def trim(self, capacity: int, expired_before: float) -> None:
        """Drop the least recent entries while more than `capacity` are held or the least
        recent was used at or before `expired_before`."""
        while self and (len(self) > capacity or next(iter(self.values())) <= expired_before):
            self.popitem(last=False)

    def discard_all(self, hashes: Sequence[BlockHash]) -> None:
        for block in hashes:
            self.pop(block, None)

    def release(self, budget: int) -> int:
        """Drop up to `budget` entries; how many were dropped."""
        done = 0
        while self and done < budget:
            self.popitem()
            done += 1
        return done

    def newest_first(self, since_s: float | None = None) -> list[tuple[BlockHash, float]]:
        """(block, last use) most recent first; with `since_s`, those used at or after it."""
        out = []
        for block, used in reversed(self.items()):
            if since_s is not None and used < since_s:
                break
            out.append((block, used))
        return out


_NEW_LRU: type[Lru] = NATIVE.Lru if NATIVE is not None else OrderedLru
"""The `Lru` a new epoch is: the compiled one where it is built."""


class MemoryIndex:
    """The synchronous core of the in-process directory, shared by the gateway and the simulator.

    Invariants:
    - The replica's current epoch (`_current[replica]`, its LRU) is the only record of what it
      holds: a lookup walks each replica's LRU along the chain, and an entry matches while it
      is younger than the TTL. There is no reverse index of block -> holders: at one probe per
      replica per matched block, plus one per replica for the first miss, a walk costs what
      the index's per-holder loop did, and the directory keeps no object per block.
    - Nothing per block is an object the cyclic GC tracks (keys are bytes, values floats): a
      directory of a million blocks is a few tracked LRUs, not a million tracked containers
      (a reverse index of `{replica: epoch}` dicts was ~225k tracked objects per engine at
      bench point 1, walked by every older-generation pass: 5-7% of the request path's CPU).
    - len(lru) <= the replica's capacity after every record() and set_capacity(): the
      setting's `capacity_blocks`, or less where the engine's KV is smaller (`set_capacity`).
    - forget() swaps in a fresh epoch in O(1); the old epoch's entries are released a bounded
      number per record() call (freeing 200k entries at once would stall the event loop).
    - With `whole_chains` (every `record` is a prompt's chain from its first block: the
      gateway's own index), a replica's epoch is *prefix-closed* while it has seen no `drop`
      and no record older than an earlier one: a block held means every block before it in its
      chain is held, and used at least as recently. Each record moves a chain's blocks to the
      newest end tail first, so a block always sits nearer that end than any block after it in
      a chain, and eviction and expiry take the oldest end first. A lookup then finds the
      replica's depth by bisection (~9 probes for a 325-block prompt) instead of a probe a
      block: the same depth and last use as the walk. A `drop` or an out-of-order record
      time puts the epoch back on the walk until the replica is forgotten.
    """

    def __init__(
        self,
        *,
        capacity_blocks: int = DEFAULT_REPLICA_CAPACITY_BLOCKS,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Clock = DIRECTORY_CLOCK,
        whole_chains: bool = False,
        lru: type[Lru] | None = None,
    ) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.capacity_blocks = capacity_blocks
        self.ttl_s = ttl_s
        self.clock = clock
        self._new_lru = lru if lru is not None else _NEW_LRU
        """What a replica's epoch is kept in (`OrderedLru`, or the compiled `Lru`)."""
        self._current: dict[str, Lru] = {}
        self._graveyard: list[Lru] = []
        self._capacities: dict[str, int] = {}
        """Replicas whose engine holds fewer blocks than `capacity_blocks` -> what it holds."""
        self.whole_chains = whole_chains
        self._newest: dict[str, float] = {}
        """Each replica's latest record time in its current epoch (`whole_chains`)."""
        self._walked: set[str] = set()
        """Replicas whose current epoch may not be prefix-closed: looked up a block at a time."""

    def capacity_of(self, replica: str) -> int:
        """Entries the replica keeps: the smaller of the setting and its engine's KV."""
        return self._capacities.get(replica, self.capacity_blocks)

    def capacities(self) -> dict[str, int]:
        """The replicas kept below the setting, with their capacity (a copy)."""
        return dict(self._capacities)

    def set_capacity(self, replica: str, engine_blocks: int | None) -> None:
        """The replica's engine holds `engine_blocks` directory entries' worth of KV (None:
        unknown, the setting applies): it keeps at most the smaller of that and the setting,
        its least recently used entries past it dropped now."""
        if engine_blocks is None or engine_blocks >= self.capacity_blocks:
            self._capacities.pop(replica, None)
            return
        capacity = self._capacities[replica] = max(engine_blocks, 1)
        lru = self._current.get(replica)
        if lru is not None:
            lru.trim(capacity, -math.inf)

    def lookup(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        return {r: d for r, (d, _) in self.lookup_detail(hashes).items()}

    def lookup_detail(self, hashes: Sequence[BlockHash]) -> dict[str, tuple[int, float]]:
        """Each replica's contiguous leading depth along `hashes`, with the last use of the
        deepest block matched; replicas matching nothing are left out."""
        if not hashes:
            return {}
        expired_before = self.clock() - self.ttl_s
        first = hashes[0]
        out: dict[str, tuple[int, float]] = {}
        walked = self._walked if self.whole_chains else None
        for replica, lru in self._current.items():
            used = lru.get(first)
            if used is None or used <= expired_before:
                continue
            if walked is not None and replica not in walked:
                out[replica] = lru.bisect(hashes, expired_before, used)
            else:
                out[replica] = lru.walk(hashes, expired_before, used)
        return out

    def record(self, replica: str, hashes: Sequence[BlockHash], now_s: float | None = None) -> None:
        """The replica holds the chain, used now (or at `now_s`, on this index's clock: a
        caller writing the same event to a second store gives both one time)."""
        now = self.clock() if now_s is None else now_s
        lru = self._current.get(replica)
        if lru is None:
            lru = self._current[replica] = self._new_lru()
        if self.whole_chains and hashes:
            if now < self._newest.get(replica, now):  # older than what it holds: walk it
                self._walked.add(replica)
            else:
                self._newest[replica] = now
        lru.touch_chain(hashes, now)
        lru.trim(self._capacities.get(replica, self.capacity_blocks), now - self.ttl_s)
        self._reap()

    def drop(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        lru = self._current.get(replica)
        if lru is None:
            return
        if hashes:
            self._walked.add(replica)  # any block, not only a chain's tail: walk it from now on
        lru.discard_all(hashes)

    def expire(self, replica: str, before_s: float) -> None:
        """Drop the replica's entries last used at or before `before_s`: the LRU's front, since
        entries are kept in order of last use."""
        lru = self._current.get(replica)
        if lru is not None:
            lru.trim(sys.maxsize, before_s)

    def forget(self, replica: str) -> None:
        self._walked.discard(replica)  # a fresh epoch: prefix-closed again
        self._newest.pop(replica, None)
        lru = self._current.pop(replica, None)
        if lru:
            self._graveyard.append(lru)

    def entries(self, replica: str, since_s: float | None = None) -> list[tuple[BlockHash, float]]:
        """The replica's live entries (block, last use), most recent first; with `since_s`,
        only those used at or after it. A copy: the caller may await while using it."""
        lru = self._current.get(replica)
        return [] if lru is None else lru.newest_first(since_s)

    def num_entries(self, replica: str | None = None) -> int:
        if replica is not None:
            lru = self._current.get(replica)
            return len(lru) if lru else 0
        return sum(len(lru) for lru in self._current.values())

    def replicas(self) -> list[str]:
        return sorted(self._current)

    def _reap(self) -> None:
        budget = _REAP_PER_CALL
        while self._graveyard and budget > 0:
            lru = self._graveyard[-1]
            budget -= lru.release(budget)
            if not lru:
                self._graveyard.pop()


class MemoryDirectory:
    """The `Directory` protocol over a `MemoryIndex`: the default, per-gateway store."""

    def __init__(self, index: MemoryIndex | None = None) -> None:
        self.index = index if index is not None else MemoryIndex()

    async def lookup(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        return self.index.lookup(hashes)

    async def record(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        self.index.record(replica, hashes)

    async def drop(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        self.index.drop(replica, hashes)

    async def forget(self, replica: str) -> None:
        self.index.forget(replica)

    async def expire(self, replica: str, before_s: float) -> None:
        self.index.expire(replica, before_s)

    async def lookup_detail(self, hashes: Sequence[BlockHash]) -> dict[str, tuple[int, float]]:
        return self.index.lookup_detail(hashes)

    async def close(self) -> None:
        return None
