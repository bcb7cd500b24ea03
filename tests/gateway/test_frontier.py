"""The live frontier builder: each replica's KvFrontier from the event index, the engine's
capacity and the conversations this gateway routed, as `kvgate sim` builds it."""

from __future__ import annotations

import random

from cachemap.events import BlockStored, EventIndex, precise_keys
from gateway.pipeline.frontier import Frontiers, LiveConversations, shared_blocks
from router.registry import build_policy, frontier_reader
from router.types import KvFrontier, Replica, RouteRequest

SALT = "s"
SYSTEM = list(range(16 * 2))  # two blocks every conversation shares


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def prompt(conversation: int, n_blocks: int) -> list[int]:
    own = [conversation * 100_000 + i for i in range(16 * (n_blocks - 2))]
    return SYSTEM + own


def store(index: EventIndex, domain: str, ids: list[int], first_hash: int) -> None:
    n = len(ids) // 16
    index.store(
        domain, BlockStored(list(range(first_hash, first_hash + n)), None, ids, 16, cache_salt=SALT)
    )


def route_of(ids: list[int], overlap: dict[str, int]) -> RouteRequest:
    keys = precise_keys(ids, SALT, 16)
    return RouteRequest(len(keys), float(len(ids)), overlap, 16.0)


def test_shared_blocks_is_the_common_chain_prefix() -> None:
    a, b = precise_keys(prompt(1, 6), SALT, 16), precise_keys(prompt(2, 4), SALT, 16)
    assert shared_blocks(a, b) == 2 and shared_blocks(a, a[:5]) == 5 and shared_blocks(a, []) == 0


def test_conversations_continue_by_chain_and_count_their_own_blocks() -> None:
    live = LiveConversations(hot_s=15.0)
    one, two = precise_keys(prompt(1, 6), SALT, 16), precise_keys(prompt(2, 10), SALT, 16)
    c1 = live.routed(one, "a", 0.0)
    c2 = live.routed(two, "b", 0.0)
    assert c1 is not None and c2 is not None and c1 != c2
    # conversation 1's next step extends its prompt: the same conversation, so not "another"
    step = precise_keys(prompt(1, 8), SALT, 16)
    assert live.live(step, 1.0) == {"b": [8]}  # two's own blocks: 10 less the shared 2
    assert live.routed(step, "a", 1.0) == c1 and len(live) == 2
    # a new conversation sees both, each less the system prompt
    new = precise_keys(prompt(3, 4), SALT, 16)
    assert live.live(new, 2.0) == {"a": [6], "b": [8]}
    # two finishes and goes quiet past the hot horizon: not live, and forgotten
    live.finished(c2)
    assert live.live(new, 15.5) == {"a": [6]} and len(live) == 1
    # one's request still runs: live past the horizon
    assert live.live(new, 30.0) == {"a": [6]}
    live.finished(c1)
    live.finished(c1)  # a second end changes nothing
    assert live.live(new, 30.0) == {}


def test_annotate_builds_each_frontier_as_deep_as_the_placement_reaches() -> None:
    clock = Clock()
    index = EventIndex(track_recency=True, clock=clock)
    scorer = frontier_reader(build_policy("cache_pressure"))
    assert scorer is not None
    capacity = {"a": 12, "b": 12, "c": None}
    frontiers = Frontiers(index, scorer, capacity.get, lambda r: r != "d", clock=clock)
    cold, hot = prompt(1, 10), prompt(2, 10)
    clock.now = 0.0
    store(index, "a", cold, 1)  # a: ten blocks used 100 s ago
    clock.now = 95.0
    store(index, "b", hot, 101)  # b: ten blocks used 5 s ago
    hot_keys = precise_keys(hot, SALT, 16)
    c = frontiers.placed("b", None, hot_keys, len(hot_keys))
    assert c is not None
    clock.now = 100.0
    new = prompt(3, 8)
    keys = precise_keys(new, SALT, 16)
    route = route_of(new, {"a": 2, "b": 2})  # both hold the system prompt
    replicas = [Replica("a"), Replica("b"), Replica("c"), Replica("d")]
    a, b, c_, d = frontiers.annotate(route, replicas, keys)
    # 6 new blocks: 2 empty, then 4 of the LRU (the shared system blocks are oldest too)
    assert a.kv_frontier == KvFrontier(2, ((4, 100.0),), 12, ())
    assert b.kv_frontier == KvFrontier(2, ((4, 5.0),), 12, (8,))  # conversation 2 lives on b
    assert c_.kv_frontier is None and d.kv_frontier is None  # no capacity / no events
    assert frontiers.num_built == 2
    # cache_pressure places it where it evicts the cold blocks; cache_aware cannot tell
    pressure, aware = build_policy("cache_pressure"), build_policy("cache_aware")
    rng = random.Random(0)
    assert pressure.decide(route, [a, b], rng).replica == "a"  # type: ignore[union-attr]
    assert aware.decide(route, [b, a], rng).replica == "b"  # type: ignore[union-attr]


def test_a_placement_touches_only_the_blocks_it_matched_there() -> None:
    clock = Clock()
    index = EventIndex(track_recency=True, clock=clock)
    scorer = frontier_reader(build_policy("cache_pressure"))
    assert scorer is not None
    frontiers = Frontiers(index, scorer, lambda r: 12, lambda r: True, clock=clock)
    cold = prompt(1, 6)
    clock.now = 0.0
    store(index, "a", cold, 1)
    keys = precise_keys(cold, SALT, 16)
    clock.now = 50.0
    frontiers.placed("a", None, keys, 0)  # matched nothing there: its order stays
    assert index.eviction_runs("a", 6, 50.0) == ((6, 50.0),)
    frontiers.placed("a", None, keys, 2)  # the first two are used now, the rest are not
    assert index.eviction_runs("a", 6, 50.0) == ((4, 50.0), (2, 0.0))


def test_annotate_leaves_out_the_requests_own_cached_prefix() -> None:
    """A conversation's next step on the replica holding its (oldest) context: placed there it
    takes that context out of the engine's free queue before allocating, so the frontier lists
    the blocks its new ones would really evict — the other conversation's, 5 s old — not its
    own, 100 s old (which read as cold and so as free to take: issue 40)."""
    clock = Clock()
    index = EventIndex(track_recency=True, clock=clock)
    scorer = frontier_reader(build_policy("cache_pressure"))
    assert scorer is not None
    frontiers = Frontiers(index, scorer, lambda r: 16, lambda r: True, clock=clock)
    mine, theirs = prompt(1, 8), prompt(2, 8)
    clock.now = 0.0
    store(index, "a", mine, 1)  # 8 blocks, the 2 system ones among them
    clock.now = 95.0
    store(index, "a", theirs[32:], 101)  # the other's own 6 (the system blocks are held)
    clock.now = 100.0
    step = mine + [7] * 16 * 4  # the next step: its 8 blocks cached, 4 new
    keys = precise_keys(step, SALT, 16)
    (a,) = frontiers.annotate(route_of(step, {"a": 8}), [Replica("a")], keys)
    # 16 − 14 held = 2 empty; the other 2 new blocks evict the other conversation's
    assert a.kv_frontier == KvFrontier(2, ((2, 5.0),), 16, ())
