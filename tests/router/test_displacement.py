"""cache_pressure: cache_aware minus what a placement evicts (issue 16, item 5).

Properties over random snapshots (hypothesis) and a narrative of exact outcomes."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.filters import LoadBoundFilter
from router.registry import RouterConfig, build_policy
from router.scorers import (
    DEFAULT_DISPLACEMENT_HALF_LIFE_S,
    DEFAULT_DISPLACEMENT_HOT_S,
    DisplacementScorer,
    displacement_blocks,
    liveness,
)
from router.types import KvFrontier, Replica, RouteRequest

BLOCK = 16.0
HALF_LIFE_S = 30.0
ROUND_1 = build_policy(
    "cache_pressure",
    RouterConfig(displacement_weight=1.0, displacement_half_life_s=30.0, displacement_hot_s=0.0),
)
"""cache_pressure as the first round measured it: weight 1, no hot horizon, half-life 30 s."""
PRESSURE = build_policy("cache_pressure")
CACHE_AWARE = build_policy("cache_aware")
BOUND = LoadBoundFilter()

runs = st.lists(
    st.tuples(st.integers(1, 400), st.floats(0.0, 600.0, allow_nan=False)), max_size=4
).map(tuple)
frontiers = st.builds(KvFrontier, st.integers(0, 400), runs)


@st.composite
def snapshots(draw: st.DrawFn) -> tuple[RouteRequest, list[Replica]]:
    num_blocks = draw(st.integers(1, 300))
    n = draw(st.integers(2, 5))
    replicas = [
        Replica(
            f"r{i}",
            pending_prefill_tokens=draw(st.sampled_from([0.0, 1e3, 5e4, 2e5, 1e6])),
            kv_frontier=draw(st.one_of(st.none(), frontiers)),
        )
        for i in range(n)
    ]
    overlap = {r.id: draw(st.integers(0, num_blocks)) for r in replicas}
    req = RouteRequest(num_blocks, num_blocks * BLOCK, overlap, tokens_per_block=BLOCK)
    return req, replicas


def _unpressured(req: RouteRequest, replicas: list[Replica]) -> list[Replica]:
    """The same replicas, each with room for its queue and the request in empty blocks (or no
    frontier)."""
    out = []
    for r in replicas:
        if r.kv_frontier is not None:
            need = DisplacementScorer().depth_blocks(req, r)
            frontier = KvFrontier(need + r.kv_frontier.empty_blocks, r.kv_frontier.runs)
            r = Replica(r.id, pending_prefill_tokens=r.pending_prefill_tokens, kv_frontier=frontier)
        out.append(r)
    return out


@settings(max_examples=300, deadline=None)
@given(snapshots(), st.integers(0, 2**32))
def test_the_choice_never_exceeds_the_load_bound(
    snap: tuple[RouteRequest, list[Replica]], seed: int
) -> None:
    req, replicas = snap
    decision = PRESSURE.decide(req, replicas, random.Random(seed))
    assert decision is not None
    assert decision.replica in {r.id for r in BOUND.filter(req, replicas)}


@settings(max_examples=300, deadline=None)
@given(snapshots(), st.integers(0, 2**32))
def test_without_pressure_it_ranks_exactly_as_cache_aware(
    snap: tuple[RouteRequest, list[Replica]], seed: int
) -> None:
    req, replicas = snap
    roomy = _unpressured(req, replicas)
    ours = PRESSURE.decide(req, roomy, random.Random(seed))
    theirs = CACHE_AWARE.decide(req, roomy, random.Random(seed))
    assert ours is not None and theirs is not None
    assert ours.ranking == theirs.ranking and ours.reason == theirs.reason


@settings(max_examples=200, deadline=None)
@given(frontiers, st.integers(0, 1000), st.integers(0, 200), st.floats(1.0, 300.0))
def test_the_cost_falls_with_free_space_and_with_idleness(
    frontier: KvFrontier, need: int, more_empty: int, older_s: float
) -> None:
    cost = displacement_blocks(frontier, need, HALF_LIFE_S)
    assert 0.0 <= cost <= max(need - frontier.empty_blocks, 0)
    roomier = KvFrontier(frontier.empty_blocks + more_empty, frontier.runs)
    assert displacement_blocks(roomier, need, HALF_LIFE_S) <= cost
    colder = KvFrontier(frontier.empty_blocks, tuple((n, t + older_s) for n, t in frontier.runs))
    assert displacement_blocks(colder, need, HALF_LIFE_S) <= cost
    assert displacement_blocks(frontier, need + 1, HALF_LIFE_S) >= cost


def _fleet(a: KvFrontier, b: KvFrontier) -> list[Replica]:
    return [Replica("a", kv_frontier=a), Replica("b", kv_frontier=b)]


@pytest.mark.parametrize("seed", range(10))
def test_a_new_conversation_prefers_free_space_then_colder_blocks(seed: int) -> None:
    """100 new blocks, both replicas matching the 20-block system prompt, no queues."""
    req = RouteRequest(120, 120 * BLOCK, {"a": 20, "b": 20}, tokens_per_block=BLOCK)
    hot = ((500, 2.0),)  # a live session's tail, used 2 s ago
    cold = ((500, 600.0),)  # a session that ended 10 minutes ago
    rng = random.Random(seed)
    free = PRESSURE.decide(req, _fleet(KvFrontier(0, hot), KvFrontier(100, hot)), rng)
    assert free is not None and free.replica == "b"
    colder = PRESSURE.decide(req, _fleet(KvFrontier(0, cold), KvFrontier(0, hot)), rng)
    assert colder is not None and colder.replica == "a"
    # cache_aware sees a tie there and breaks it by the (equal) load: either one
    winners = {
        d.replica
        for s in range(30)
        if (
            d := CACHE_AWARE.decide(
                req, _fleet(KvFrontier(0, cold), KvFrontier(0, hot)), random.Random(s)
            )
        )
    }
    assert winners == {"a", "b"}


def test_with_weight_zero_displacement_only_breaks_ties() -> None:
    """Equal matches: the colder replica wins even at weight 0; a longer match wins there
    even when it displaces hot blocks, which weight 1 refuses."""
    tie_break_only = build_policy("cache_pressure", RouterConfig(displacement_weight=0.0))
    req = RouteRequest(120, 120 * BLOCK, {"a": 20, "b": 20}, tokens_per_block=BLOCK)
    cold, hot = KvFrontier(0, ((500, 600.0),)), KvFrontier(0, ((500, 0.0),))
    decision = tie_break_only.decide(req, _fleet(cold, hot), random.Random(0))
    assert decision is not None and decision.replica == "a"
    longer = RouteRequest(120, 120 * BLOCK, {"a": 20, "b": 30}, tokens_per_block=BLOCK)
    decision = tie_break_only.decide(longer, _fleet(cold, hot), random.Random(0))
    assert decision is not None and decision.replica == "b"  # 30 cached beats 20
    decision = PRESSURE.decide(longer, _fleet(cold, hot), random.Random(0))
    assert decision is not None and decision.replica == "a"  # 20 − 0 beats 30 − 90


def test_a_returning_conversation_stays_where_its_prefix_is_unless_staying_evicts_more() -> None:
    """Its holder matches 100 of 120 blocks; staying costs 20 new blocks there."""
    req = RouteRequest(120, 120 * BLOCK, {"a": 100, "b": 0}, tokens_per_block=BLOCK)
    hot_a = KvFrontier(0, ((1000, 0.0),))  # every block a's 20 would evict is in use now
    roomy_b = KvFrontier(1000)
    decision = PRESSURE.decide(req, _fleet(hot_a, roomy_b), random.Random(0))
    # a: 100 cached − 20 displaced = 80; b: 0 cached − 0 displaced = 0
    assert decision is not None and decision.replica == "a"
    assert decision.reason == "prefix"


def test_the_half_life_is_validated_and_weighs_idle_blocks_by_halves() -> None:
    with pytest.raises(ValueError, match="half-life must be positive"):
        DisplacementScorer(0.0)
    frontier = KvFrontier(10, ((10, 0.0), (10, 30.0), (10, 60.0)))
    assert displacement_blocks(frontier, 10, HALF_LIFE_S) == 0.0
    assert displacement_blocks(frontier, 40, HALF_LIFE_S) == pytest.approx(10 + 5 + 2.5)
    assert displacement_blocks(frontier, 45, HALF_LIFE_S) == pytest.approx(10 + 5 + 2.5 + 5)
    with pytest.raises(ValueError, match="displacement_weight must be non-negative"):
        RouterConfig(displacement_weight=-1.0)
    config = RouterConfig(displacement_half_life_s=60.0)
    scorer = build_policy("cache_pressure", config).scorers[1][0]
    assert isinstance(scorer, DisplacementScorer) and scorer.half_life_s == 60.0


@settings(max_examples=300, deadline=None)
@given(
    st.floats(0.0, 1e4, allow_nan=False),
    st.floats(0.0, 1e3, allow_nan=False),
    st.floats(0.0, 60.0, allow_nan=False),
    st.floats(0.1, 100.0, allow_nan=False),
)
def test_liveness_is_whole_within_the_horizon_then_halves_every_half_life(
    idle_s: float, later_s: float, hot_s: float, half_life_s: float
) -> None:
    value = liveness(idle_s, hot_s, half_life_s)
    assert 0.0 <= value <= 1.0
    assert liveness(idle_s + later_s, hot_s, half_life_s) <= value
    if idle_s < hot_s:
        assert value == 1.0
    else:
        assert liveness(idle_s + half_life_s, hot_s, half_life_s) == pytest.approx(value / 2)
    # a hot horizon only ever makes a block dearer than the plain half-life did
    assert value >= liveness(idle_s, 0.0, half_life_s)


@settings(max_examples=200, deadline=None)
@given(frontiers, st.integers(0, 1000), st.floats(0.0, 60.0), st.floats(0.0, 60.0))
def test_a_longer_hot_horizon_never_makes_a_placement_cheaper(
    frontier: KvFrontier, need: int, hot_s: float, more_s: float
) -> None:
    plain = displacement_blocks(frontier, need, HALF_LIFE_S)
    hot = displacement_blocks(frontier, need, HALF_LIFE_S, hot_s)
    hotter = displacement_blocks(frontier, need, HALF_LIFE_S, hot_s + more_s)
    assert plain <= hot + 1e-9 and hot <= hotter + 1e-9
    assert hotter <= max(need - frontier.empty_blocks, 0)


def test_blocks_within_the_hot_horizon_weigh_whole_blocks() -> None:
    """15 s horizon, 5 s half-life: idle 5 s → 1, 20 s → 1/2, 25 s → 1/4."""
    frontier = KvFrontier(10, ((10, 5.0), (10, 20.0), (10, 25.0)))
    assert displacement_blocks(frontier, 40, 5.0, 15.0) == pytest.approx(10 + 5 + 2.5)
    assert (DEFAULT_DISPLACEMENT_HOT_S, DEFAULT_DISPLACEMENT_HALF_LIFE_S) == (15.0, 5.0)
    scorer = build_policy("cache_pressure").scorers[1][0]
    assert isinstance(scorer, DisplacementScorer)
    assert (scorer.hot_s, scorer.half_life_s) == (15.0, 5.0)
    with pytest.raises(ValueError, match="hot horizon must be non-negative"):
        build_policy("cache_pressure", RouterConfig(displacement_hot_s=-1.0))


def test_a_session_eroded_on_a_thrashing_replica_moves_to_cold_room() -> None:
    """Session X returns with 400 blocks; its replica a still holds 300 (its tail was evicted:
    60 lost, 40 new). Every evictable block on a belongs to live sessions between steps (used
    8 s ago); b holds only sessions that ended ten minutes ago.

    Staying re-prefills 100 blocks on a and evicts 100 live ones, whose owners re-prefill them
    and evict the next: round 2 scores a 300 − 4 × 100 = −100 against b's 0 − 4 × ~0, and
    moves X once; round 1 stays (300 − 100 × 2^(−8/30) ≈ 217 > 0) and the thrash goes on."""
    req = RouteRequest(400, 400 * BLOCK, {"a": 300, "b": 45}, tokens_per_block=BLOCK)
    thrashing = KvFrontier(0, ((2000, 8.0),))
    ended = KvFrontier(0, ((3000, 600.0),))
    for seed in range(5):
        moved = PRESSURE.decide(req, _fleet(thrashing, ended), random.Random(seed))
        assert moved is not None and moved.replica == "b"
        stayed = ROUND_1.decide(req, _fleet(thrashing, ended), random.Random(seed))
        assert stayed is not None and stayed.replica == "a"
    # a step that only grows (its 20 new blocks, nothing lost) stays: 380 − 4 × 20 > 0
    growing = RouteRequest(400, 400 * BLOCK, {"a": 380, "b": 45}, tokens_per_block=BLOCK)
    decision = PRESSURE.decide(growing, _fleet(thrashing, ended), random.Random(0))
    assert decision is not None and decision.replica == "a" and decision.reason == "prefix"


def test_a_new_session_is_admitted_where_the_tail_ended_not_between_steps() -> None:
    """A new session (the 45-block system prompt everywhere, 140 blocks of its own). a's tail
    is a live session between steps (idle 12 s: within the horizon); b's ended 40 s ago (25 s
    past it: weight 1/32). Round 2 places it on b; round 1's plain half-life weighs the two
    0.76 and 0.40, so it agrees here, and both keep away from a's live tail."""
    req = RouteRequest(185, 185 * BLOCK, {"a": 45, "b": 45}, tokens_per_block=BLOCK)
    live, ended = KvFrontier(0, ((1000, 12.0),)), KvFrontier(0, ((1000, 40.0),))
    for seed in range(5):
        for policy in (PRESSURE, ROUND_1):
            decision = policy.decide(req, _fleet(live, ended), random.Random(seed))
            assert decision is not None and decision.replica == "b"
    b = DisplacementScorer().displaced_blocks(req, Replica("b", kv_frontier=ended))
    assert b == pytest.approx(140 / 32)


def test_empty_blocks_a_queue_will_take_are_not_room() -> None:
    """a shows 150 empty blocks, but 150 blocks' worth of prefill is queued there ahead of the
    request (the engine allocates at prefill start, first come first served): the request's
    100 new blocks evict 100 live ones on a. b has 50 empty and no queue, then blocks idle 20 s
    (liveness 1/2): 50 × 1/2 = 25. Counting a's empty blocks as room would have chosen a."""
    req = RouteRequest(100, 100 * BLOCK, {}, tokens_per_block=BLOCK)
    a = Replica(
        "a", pending_prefill_tokens=150 * BLOCK, kv_frontier=KvFrontier(150, ((1000, 0.0),))
    )
    b = Replica("b", kv_frontier=KvFrontier(50, ((1000, 20.0),)))
    scorer = DisplacementScorer()
    assert scorer.queued_blocks(req, a) == 150 and scorer.depth_blocks(req, a) == 250
    assert scorer.displaced_blocks(req, a) == pytest.approx(100.0)
    assert scorer.displaced_blocks(req, b) == pytest.approx(25.0)
    for seed in range(5):
        decision = PRESSURE.decide(req, [a, b], random.Random(seed))
        assert decision is not None and decision.replica == "b"
