"""cache_pressure round 3: on a replica whose live conversations no longer fit, the cheapest
one moves (issue 16, item 5). A narrative of exact outcomes, then the property that keeps
every other snapshot's ranking as round 2's."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from router.registry import RouterConfig, build_policy
from router.scorers import CrowdingScorer, crowding
from router.types import KvFrontier, Replica, RouteRequest

BLOCK = 16.0
PRESSURE = build_policy("cache_pressure")
ROUND_2 = build_policy("cache_pressure", RouterConfig(crowding_weight=0.0))
"""cache_pressure as round 2 measured it: no crowding rule."""

CAPACITY = 1000
SYSTEM = 10
"""Every session's first 10 blocks are the shared system prompt, cached on both replicas."""


def _fleet(a_live: tuple[int, ...]) -> list[Replica]:
    """a: full, every evictable block a live session's (idle 5 s), the other live sessions'
    own blocks `a_live`; b: 500 empty blocks and one live session of 300 (room for anyone
    here)."""
    a = KvFrontier(0, ((CAPACITY, 5.0),), CAPACITY, a_live)
    b = KvFrontier(500, ((500, 600.0),), CAPACITY, (300,))
    return [Replica("a", kv_frontier=a), Replica("b", kv_frontier=b)]


def test_a_replica_whose_live_sessions_do_not_fit_moves_the_cheapest_one() -> None:
    """Replica a (1,000 blocks) holds three live sessions: young Y (200 blocks, 190 cached),
    and two older ones with 480 and 400 blocks of their own. At their next steps they need
    1,080: one must leave a, and leaving costs a session what it has there.

    Y's step: its stake on a is 190 − 10 (b has the system prompt) = 180, less than either
    other's 400 or 480, so Y is the cheapest: it pays 180 + the 80 blocks of overcommit and
    moves to b, where it fits. Round 2 sees only Y's 10 new blocks evicting live ones (4 × 10)
    and keeps it (0.95 − 0.2 > 0.05): the replica keeps thrashing until the one that happens
    to be eroded most moves, whatever its size."""
    young = RouteRequest(200, 200 * BLOCK, {"a": 190, "b": SYSTEM}, tokens_per_block=BLOCK)
    fleet = _fleet((480, 400))
    assert crowding(young, fleet[0]) == (80, 180, 400)
    assert CrowdingScorer.cost_blocks(young, fleet[0]) == 260.0
    assert CrowdingScorer.cost_blocks(young, fleet[1]) == 0.0
    for seed in range(5):
        moved = PRESSURE.decide(young, fleet, random.Random(seed))
        assert moved is not None and moved.replica == "b"
        stayed = ROUND_2.decide(young, fleet, random.Random(seed))
        assert stayed is not None and stayed.replica == "a"


def test_a_new_session_keeps_off_a_crowded_replica() -> None:
    """A new session (only the system prompt cached anywhere, 150 blocks) has no stake
    anywhere, so it is the cheapest wherever the live sessions would not fit with it: a's
    880 + 150 > 1,000 costs it the 30-block overcommit; b (300 + 150) costs nothing."""
    new = RouteRequest(150, 150 * BLOCK, {"a": SYSTEM, "b": SYSTEM}, tokens_per_block=BLOCK)
    fleet = _fleet((480, 400))
    assert CrowdingScorer.cost_blocks(new, fleet[0]) == 30.0
    decision = PRESSURE.decide(new, fleet, random.Random(0))
    assert decision is not None and decision.replica == "b"


live = st.lists(st.integers(1, 400), max_size=4).map(tuple)


@st.composite
def uncrowded(draw: st.DrawFn) -> tuple[RouteRequest, list[Replica]]:
    """Snapshots where every replica has room for the request and its live conversations (or
    says nothing of them)."""
    num_blocks = draw(st.integers(1, 300))
    replicas = []
    for i in range(draw(st.integers(2, 5))):
        others = draw(live)
        capacity = draw(st.sampled_from([0, num_blocks + sum(others) + draw(st.integers(0, 500))]))
        runs = tuple(
            draw(st.lists(st.tuples(st.integers(1, 400), st.floats(0.0, 600.0)), max_size=3))
        )
        frontier = KvFrontier(draw(st.integers(0, 400)), runs, capacity, others)
        replicas.append(
            Replica(
                f"r{i}",
                pending_prefill_tokens=draw(st.sampled_from([0.0, 1e3, 5e4, 2e5])),
                kv_frontier=draw(st.one_of(st.none(), st.just(frontier))),
            )
        )
    overlap = {r.id: draw(st.integers(0, num_blocks)) for r in replicas}
    return RouteRequest(num_blocks, num_blocks * BLOCK, overlap, tokens_per_block=BLOCK), replicas


@settings(max_examples=300, deadline=None)
@given(uncrowded(), st.integers(0, 2**32))
def test_without_crowding_the_ranking_is_round_2s(
    snap: tuple[RouteRequest, list[Replica]], seed: int
) -> None:
    req, replicas = snap
    now = PRESSURE.decide(req, replicas, random.Random(seed))
    before = ROUND_2.decide(req, replicas, random.Random(seed))
    assert now == before
