"""One decision computes each replica's shared values once (`router.types.DecisionMemo`):
the load bound and the tie-break read the same loads, the displacement cost and its tie-break
the same displaced blocks, and the one-walk displacement is the two-walk difference exactly."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from router.filters import LoadBoundFilter
from router.scorers import (
    DisplacementScorer,
    EstimatedWorkScorer,
    WorkAndDisplacementScorer,
    displacement_blocks,
)
from router.types import DecisionMemo, KvFrontier, Replica, RouteRequest

BLOCK = 16.0
FLEET = [Replica("a"), Replica("b"), Replica("c")]
REQ = RouteRequest(10, 10 * BLOCK, {"a": 10}, tokens_per_block=BLOCK)


def test_the_filter_and_the_tie_break_read_the_loads_the_memo_holds() -> None:
    """Loads planted in the memo (c least loaded, a most) are what both act on: computed from
    the snapshot instead, a would be the least loaded (its prefix is cached) and c tie b."""
    memo = DecisionMemo(REQ)
    planted = {"a": 900_000.0, "b": 500.0, "c": 0.0}
    memo.values("load", FLEET, lambda req, r: planted[r.id])
    kept = LoadBoundFilter(100.0, 0.0).filter(REQ, FLEET, memo)
    assert [r.id for r in kept] == ["c"]
    scores = EstimatedWorkScorer().score(REQ, FLEET, random.Random(0), memo)
    assert scores == {"a": 0.0, "b": 1 - 500 / 900_000, "c": 1.0}
    # without a memo each makes its own from the snapshot
    assert [r.id for r in LoadBoundFilter(100.0, 0.0).filter(REQ, FLEET)] == ["a"]


def test_each_value_is_computed_once_per_replica() -> None:
    calls: list[str] = []

    def count(req: RouteRequest, replica: Replica) -> float:
        calls.append(replica.id)
        return 1.0

    memo = DecisionMemo(REQ)
    assert memo.values("x", FLEET, count) == [1.0, 1.0, 1.0]
    assert memo.values("x", FLEET[1:], count) == [1.0, 1.0]
    assert memo.values("y", FLEET[:1], count) == [1.0]
    assert calls == ["a", "b", "c", "a"]


def test_the_tie_break_reads_the_displacement_the_cost_computed() -> None:
    """Displaced blocks planted under the scorer's name reach `WorkAndDisplacementScorer` (it
    shares the parameters): b displacing 100 blocks ranks last though nothing is evicted."""
    scorer = DisplacementScorer()
    memo = DecisionMemo(REQ)
    memo.values(scorer.memo_key, FLEET, lambda req, r: 100.0 if r.id == "b" else 0.0)
    scores = WorkAndDisplacementScorer().score(REQ, FLEET, random.Random(0), memo)
    assert min(scores, key=scores.__getitem__) == "b"
    assert DisplacementScorer(1.0, 2.0).memo_key != scorer.memo_key


runs = st.lists(
    st.tuples(st.integers(1, 400), st.floats(0.0, 600.0, allow_nan=False)), max_size=5
).map(tuple)


@settings(max_examples=400, deadline=None)
@given(
    st.integers(0, 400),
    runs,
    st.integers(1, 600),
    st.integers(0, 600),
    st.floats(0.0, 1e5),
    st.sampled_from([(5.0, 15.0), (30.0, 0.0)]),
)
def test_one_walk_is_the_difference_of_two_to_the_bit(
    empty: int,
    frontier_runs: tuple[tuple[int, float], ...],
    num_blocks: int,
    cached: int,
    queued_tokens: float,
    params: tuple[float, float],
) -> None:
    half_life_s, hot_s = params
    scorer = DisplacementScorer(half_life_s, hot_s)
    frontier = KvFrontier(empty, frontier_runs)
    replica = Replica("r", pending_prefill_tokens=queued_tokens, kv_frontier=frontier)
    req = RouteRequest(
        num_blocks, num_blocks * BLOCK, {"r": min(cached, num_blocks)}, tokens_per_block=BLOCK
    )
    queued = scorer.queued_blocks(req, replica)
    total = queued + scorer.need_blocks(req, "r")
    expected = displacement_blocks(frontier, total, half_life_s, hot_s)
    if queued:
        expected -= displacement_blocks(frontier, queued, half_life_s, hot_s)
    assert scorer.displaced_blocks(req, replica) == max(expected, 0.0)


def test_with_frontier_is_replace_of_the_frontier_alone() -> None:
    """`Replica.with_frontier` copies the other fields by position: every field set to a
    value of its own, the copy equals `dataclasses.replace` (a field added after
    `kv_frontier`, or reordered, fails here)."""
    import dataclasses

    values: dict[str, object] = {}
    for n, f in enumerate(dataclasses.fields(Replica)):
        values[f.name] = {"id": "r", "healthy": False, "kv_frontier": None}.get(f.name, n + 0.5)
    replica = Replica(**values)  # type: ignore[arg-type]
    frontier = KvFrontier(3, ((2, 1.0),), 10, (4,))
    assert dataclasses.fields(Replica)[-1].name == "kv_frontier"
    assert replica.with_frontier(frontier) == dataclasses.replace(replica, kv_frontier=frontier)
    assert replica.with_frontier(None) == replica
