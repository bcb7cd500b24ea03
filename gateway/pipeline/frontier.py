"""Frontiers: each replica's KV eviction frontier for `cache_pressure`, built live in precise
mode from what the gateway knows (issue 16, placement under cache pressure).

    the event index (per domain: GPU blocks in eviction order, each run's last use;
                     `cachemap.recency`, fed by BlockStored and by this gateway's placements)
  + the engine's capacity (`vllm:cache_config_info{num_gpu_blocks=...}` on its /metrics)
  + the conversations this gateway routed (`LiveConversations`)
  ──▶ KvFrontier(empty, runs as deep as this request's placement would evict, capacity, live)

the same record `kvgate sim` builds from its engine model (`loadgen.sim`'s `frontier()` and
`_Conversations`), so the router (pure, `router.scorers`) ranks live exactly as it ranks
there. A replica whose events do not flow, or whose capacity is unknown, gets no frontier:
it ranks as `cache_aware` ranks it.

Cost, per request: one walk per replica over its eviction runs, stopped at the placement's
depth (runs, not blocks: a store or a touch is one run), and one pass over the live
conversations (a binary search of shared keys each); per placement one touch of the matched
blocks (two C-level passes over them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from cachemap.events import GPU, domain_of
from cachemap.keys import BlockHash
from gateway.request.state import ExchangeRecord
from gateway.request.usage import EngineUsage
from router.scorers import DisplacementScorer
from router.types import KvFrontier, Replica, RouteRequest

MAX_CONVERSATIONS = 4096
"""Conversations tracked at most (the least recently routed go first): far above the live
ones of any fleet whose KV holds only a few conversations per replica."""
MAX_RUNNING_S = 600.0
"""A conversation whose request never reported its end (a 4xx passed through, a lost
exchange) stops counting as running after 10 minutes."""


class RecencySource(Protocol):
    """Where a domain's eviction order is read: the in-process `cachemap.events.EventIndex`
    (with `track_recency`), or the shared index's `cachemap.redis.frontiers.SharedFrontiers`."""

    def num_blocks(self, domain: str, tier: int = GPU) -> int: ...

    def eviction_runs(
        self, domain: str, depth: int, now_s: float, exclude: Sequence[BlockHash] = ()
    ) -> tuple[tuple[int, float], ...]: ...

    def touch(self, domain: str, keys: Sequence[BlockHash], now_s: float) -> int: ...


def shared_blocks(a: Sequence[BlockHash], b: Sequence[BlockHash]) -> int:
    """Leading keys two chains share. A chain key names its whole prefix, so keys equal at i
    are equal before i: a binary search of key compares."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            low = mid
        else:
            high = mid - 1
    return low


@dataclass(slots=True)
class _Conversation:
    replica: str
    routed_s: float
    keys: Sequence[BlockHash]
    running: int = 0


class LiveConversations:
    """Who needs each replica soon, from this gateway's own routing: per conversation its last
    replica, when it was routed there, its keys, and whether that request still runs. A
    request continues the conversation whose last prompt its keys extend (the longest such);
    otherwise it starts one. A conversation is live while a request of it runs or was routed
    within `hot_s`; its own blocks, against a request being placed, are those beyond what the
    two share (shared leading blocks, a common system prompt, count once: cached for both)."""

    def __init__(self, hot_s: float) -> None:
        self.hot_s = hot_s
        self._entries: dict[int, _Conversation] = {}
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _live(self, c: _Conversation, now_s: float) -> bool:
        age = now_s - c.routed_s
        return age < self.hot_s or (c.running > 0 and age < MAX_RUNNING_S)

    def _continued(self, keys: Sequence[BlockHash]) -> int | None:
        best, best_len = None, -1
        for cid, c in self._entries.items():
            n = len(c.keys)
            if n > best_len and n <= len(keys) and c.keys[n - 1] == keys[n - 1]:
                best, best_len = cid, n
        return best

    def live(self, keys: Sequence[BlockHash], now_s: float) -> dict[str, list[int]]:
        """Per replica, the own blocks of every other live conversation there."""
        out: dict[str, list[int]] = {}
        if not keys:
            return out
        mine = self._continued(keys)
        for cid, c in list(self._entries.items()):
            if not self._live(c, now_s):
                del self._entries[cid]  # routed again, it comes back
                continue
            if cid == mine:
                continue
            out.setdefault(c.replica, []).append(len(c.keys) - shared_blocks(c.keys, keys))
        return out

    def routed(self, keys: Sequence[BlockHash], replica: str, now_s: float) -> int | None:
        """The request was placed on `replica`; returns its conversation (None: no full block,
        not tracked) for `finished`."""
        if not keys:
            return None
        cid = self._continued(keys)
        c = self._entries.pop(cid) if cid is not None else None
        if c is None:
            cid, self._next = self._next, self._next + 1
            c = _Conversation(replica, now_s, keys)
        c.replica, c.routed_s, c.keys = replica, now_s, keys
        c.running += 1
        assert cid is not None
        self._entries[cid] = c  # newest last: the oldest are dropped first
        while len(self._entries) > MAX_CONVERSATIONS:
            del self._entries[next(iter(self._entries))]
        return cid

    def finished(self, conversation: int | None) -> None:
        c = self._entries.get(conversation) if conversation is not None else None
        if c is not None and c.running > 0:
            c.running -= 1


class Frontiers:
    """Builds each candidate's `KvFrontier` for a request, and learns from placements (module
    docstring). `capacity(replica)` is its engine's KV blocks per domain (None: unknown);
    `live(replica)` whether its events flow; `dp_size(replica)` its DP ranks. `index` and
    `live` are set again when the gateway joins a shared index (`gateway.server.app`)."""

    def __init__(
        self,
        index: RecencySource,
        scorer: DisplacementScorer,
        capacity: Callable[[str], int | None],
        live: Callable[[str], bool],
        dp_size: Callable[[str], int] = lambda replica: 1,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.index = index
        self.scorer = scorer
        self.capacity = capacity
        self.live = live
        self.dp_size = dp_size
        self.clock = clock
        self.conversations = LiveConversations(scorer.hot_s)
        self.num_built = 0

    def _domain(self, replica: str, rank: int | None) -> str:
        return domain_of(replica, rank or 0, self.dp_size(replica))

    def annotate(
        self,
        route: RouteRequest,
        replicas: Sequence[Replica],
        keys: Sequence[BlockHash],
        ranks: dict[str, int] | None = None,
    ) -> list[Replica]:
        """`replicas` with their frontiers for this request (those with events and a capacity)."""
        now = self.clock()
        live = self.conversations.live(keys, now)
        ranks = ranks or {}
        overlap = route.overlap
        capacity_of, is_live, index, depth_blocks = (
            self.capacity,
            self.live,
            self.index,
            self.scorer.depth_blocks,
        )
        out: list[Replica] = []
        for r in replicas:
            capacity = capacity_of(r.id)
            if not capacity or not is_live(r.id):
                out.append(r)
                continue
            domain = self._domain(r.id, ranks.get(r.id))
            empty = max(capacity - index.num_blocks(domain, GPU), 0)
            depth = depth_blocks(route, r) - empty
            # the request's own cached prefix there is no block its placement evicts: the
            # engine takes it out of its free queue before allocating (issue 40)
            own = keys[: overlap.get(r.id, 0)]
            runs = index.eviction_runs(domain, depth, now, own) if depth > 0 else ()
            out.append(
                r.with_frontier(KvFrontier(empty, runs, capacity, tuple(live.get(r.id, ()))))
            )
            self.num_built += 1
        return out

    def placed(
        self, replica: str, rank: int | None, keys: Sequence[BlockHash], matched: int
    ) -> int | None:
        """The request was placed: its `matched` leading blocks there become the newest (the
        engine takes them out of its free queue; nothing to touch past them, and in shared
        mode nothing to send), and its conversation is routed there."""
        now = self.clock()
        if matched > 0:
            self.index.touch(self._domain(replica, rank), keys[:matched], now)
        return self.conversations.routed(keys, replica, now)

    def finished(self, conversation: int | None) -> None:
        self.conversations.finished(conversation)


class FrontierObserver:
    """Tells the frontiers when a placed request's exchange ends (its conversation is then
    live only until its hot horizon)."""

    def __init__(self, frontiers: Frontiers) -> None:
        self.frontiers = frontiers

    async def on_first_token(self, record: ExchangeRecord) -> None:
        pass

    async def on_usage(self, record: ExchangeRecord, usage: EngineUsage) -> None:
        pass

    async def on_finish(self, record: ExchangeRecord) -> None:
        self.frontiers.finished(record.routed.conversation)
