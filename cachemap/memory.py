"""The in-process directory: the reference implementation and the default store."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import count

from cachemap.directory import (
    DEFAULT_REPLICA_CAPACITY_BLOCKS,
    DEFAULT_TTL_S,
    DIRECTORY_CLOCK,
    Clock,
)
from cachemap.keys import BlockHash

_REAP_PER_CALL = 1024
"""Entries of forgotten epochs cleaned up per record() call: bounded work on the hot path."""


class _Epoch:
    """One replica's entries in one epoch: an LRU of block hash -> last use time.

    LRU at the front. A chain is touched tail first, so block 0 is the most recent of its
    chain and, on ties, the longer chain's tail is evicted first (as vLLM frees blocks).
    `number` names the epoch in the index (unique within its `MemoryIndex`).
    """

    __slots__ = ("lru", "number", "replica")

    def __init__(self, replica: str, number: int) -> None:
        self.replica = replica
        self.number = number
        self.lru: OrderedDict[BlockHash, float] = OrderedDict()


class MemoryIndex:
    """The synchronous core of the in-process directory, shared by the gateway and the simulator.

    Invariants:
    - `_index[h][replica]` is the number of the `_Epoch` that recorded h; it matches only while
      that epoch is the replica's current one (`_current[replica].number`) and its entry is
      younger than the TTL.
    - Every per-block holder dict holds only strings and ints, so CPython never tracks it in
      the cyclic GC: a directory of a million blocks adds no object for the collector to walk
      (holding the `_Epoch` itself made each one tracked, ~225k per engine at bench point 1,
      and every older-generation pass walked them all: 5-7% of the request path's CPU).
    - Every live index entry of a current epoch is in that epoch's LRU, and vice versa;
      len(lru) <= capacity after every record().
    - forget() swaps in a fresh epoch in O(1); the old epoch's entries are reaped a bounded
      number per record() call.
    """

    def __init__(
        self,
        *,
        capacity_blocks: int = DEFAULT_REPLICA_CAPACITY_BLOCKS,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Clock = DIRECTORY_CLOCK,
    ) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        self.capacity_blocks = capacity_blocks
        self.ttl_s = ttl_s
        self.clock = clock
        self._index: dict[BlockHash, dict[str, int]] = {}
        self._current: dict[str, _Epoch] = {}
        self._graveyard: list[_Epoch] = []
        self._numbers = count()

    def lookup(self, hashes: Sequence[BlockHash]) -> dict[str, int]:
        return {r: d for r, (d, _) in self.lookup_detail(hashes).items()}

    def lookup_detail(self, hashes: Sequence[BlockHash]) -> dict[str, tuple[int, float]]:
        expired_before = self.clock() - self.ttl_s
        depth: dict[str, int] = {}
        for i, block in enumerate(hashes):
            holders = self._index.get(block)
            if not holders:
                break
            advanced = False
            for replica, number in holders.items():
                if depth.get(replica, 0) != i:
                    continue
                epoch = self._current.get(replica)
                if (
                    epoch is not None
                    and epoch.number == number
                    and epoch.lru[block] > expired_before
                ):
                    depth[replica] = i + 1
                    advanced = True
            if not advanced:
                break
        return {
            replica: (d, self._current[replica].lru[hashes[d - 1]]) for replica, d in depth.items()
        }

    def record(self, replica: str, hashes: Sequence[BlockHash], now_s: float | None = None) -> None:
        """The replica holds the chain, used now (or at `now_s`, on this index's clock: a
        caller writing the same event to a second store gives both one time)."""
        now = self.clock() if now_s is None else now_s
        epoch = self._current.get(replica)
        if epoch is None:
            epoch = self._current[replica] = _Epoch(replica, next(self._numbers))
        lru = epoch.lru
        number = epoch.number
        index = self._index
        for block in reversed(hashes):
            lru[block] = now
            lru.move_to_end(block)
            holders = index.get(block)
            if holders is None:
                index[block] = {replica: number}
            else:
                holders[replica] = number
        expired_before = now - self.ttl_s
        while lru and (
            len(lru) > self.capacity_blocks or next(iter(lru.values())) <= expired_before
        ):
            block, _ = lru.popitem(last=False)
            self._unindex(block, epoch)
        self._reap()

    def drop(self, replica: str, hashes: Sequence[BlockHash]) -> None:
        epoch = self._current.get(replica)
        if epoch is None:
            return
        for block in hashes:
            if epoch.lru.pop(block, None) is not None:
                self._unindex(block, epoch)

    def expire(self, replica: str, before_s: float) -> None:
        """Drop the replica's entries last used at or before `before_s`: the LRU's front, since
        entries are kept in order of last use."""
        epoch = self._current.get(replica)
        if epoch is None:
            return
        lru = epoch.lru
        while lru and next(iter(lru.values())) <= before_s:
            block, _ = lru.popitem(last=False)
            self._unindex(block, epoch)

    def forget(self, replica: str) -> None:
        epoch = self._current.pop(replica, None)
        if epoch is not None and epoch.lru:
            self._graveyard.append(epoch)

    def entries(self, replica: str, since_s: float | None = None) -> list[tuple[BlockHash, float]]:
        """The replica's live entries (block, last use), most recent first; with `since_s`,
        only those used at or after it. A copy: the caller may await while using it."""
        epoch = self._current.get(replica)
        if epoch is None:
            return []
        out = []
        for block, used in reversed(epoch.lru.items()):
            if since_s is not None and used < since_s:
                break
            out.append((block, used))
        return out

    def num_entries(self, replica: str | None = None) -> int:
        if replica is not None:
            epoch = self._current.get(replica)
            return len(epoch.lru) if epoch else 0
        return sum(len(e.lru) for e in self._current.values())

    def replicas(self) -> list[str]:
        return sorted(self._current)

    def _unindex(self, block: BlockHash, epoch: _Epoch) -> None:
        holders = self._index.get(block)
        if holders is not None and holders.get(epoch.replica) == epoch.number:
            del holders[epoch.replica]
            if not holders:
                del self._index[block]

    def _reap(self) -> None:
        budget = _REAP_PER_CALL
        while self._graveyard and budget > 0:
            epoch = self._graveyard[-1]
            while epoch.lru and budget > 0:
                block, _ = epoch.lru.popitem()
                self._unindex(block, epoch)
                budget -= 1
            if not epoch.lru:
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
