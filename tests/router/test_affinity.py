"""Conversation affinity in the router (issue 40): a conversation evicted everywhere goes back
to the replica its previous request went to, within the load bound, and residency still wins."""

from __future__ import annotations

import random

import pytest

from router.registry import RouterConfig, build_policy
from router.scorers import ConversationScorer
from router.types import Replica, RouteRequest

BLOCK = 512.0
SYSTEM = 5
"""Blocks of the system prompt every replica holds."""


def _turn(home: str | None, overlap: dict[str, int], num_blocks: int = 60) -> RouteRequest:
    return RouteRequest(
        num_blocks,
        num_blocks * BLOCK,
        overlap,
        tokens_per_block=BLOCK,
        home=home,
        home_blocks=55 if home is not None else 0,
    )


def _fleet(pending: dict[str, float]) -> list[Replica]:
    return [Replica(rid, pending_prefill_tokens=p) for rid, p in pending.items()]


@pytest.mark.parametrize("policy", ["cache_aware", "cache_pressure"])
def test_evicted_everywhere_the_turn_goes_home_not_to_the_least_loaded(policy: str) -> None:
    everywhere = {"r0": SYSTEM, "r1": SYSTEM, "r2": SYSTEM}
    fleet = _fleet({"r0": 0.0, "r1": 20_000.0, "r2": 40_000.0})  # within the 131k slack
    profile = build_policy(policy)
    lost = profile.decide(_turn(None, everywhere), fleet, random.Random(0))
    assert lost is not None and lost.replica == "r0", "without a home: the least load"
    kept = profile.decide(_turn("r2", everywhere), fleet, random.Random(0))
    assert kept is not None and kept.replica == "r2"
    assert kept.reason == "prefix" and kept.matched_blocks == SYSTEM
    off = build_policy(policy, RouterConfig(affinity_weight=0.0))
    assert off.decide(_turn("r2", everywhere), fleet, random.Random(0)).replica == "r0"  # type: ignore[union-attr]


def test_residency_beats_the_home_and_the_credit_shrinks_by_what_is_held() -> None:
    scorer = ConversationScorer()
    fleet = _fleet({"r0": 0.0, "r1": 0.0, "r2": 0.0})
    held = _turn("r2", {"r0": SYSTEM, "r1": 55, "r2": SYSTEM})
    assert scorer.score(held, fleet, random.Random(0)) == {"r0": 0.0, "r1": 0.0, "r2": 0.0}
    decision = build_policy("cache_aware").decide(held, fleet, random.Random(0))
    assert decision is not None and decision.replica == "r1"
    partly = _turn("r2", {"r0": SYSTEM, "r1": 30, "r2": SYSTEM})
    assert scorer.score(partly, fleet, random.Random(0))["r2"] == pytest.approx(25 / 60)
    # r2: 5/60 + 25/60 = 30/60 against r1's 30/60: a tie, which the load breaks
    lost = _turn("r2", {"r0": SYSTEM, "r1": SYSTEM, "r2": SYSTEM})
    assert scorer.score(lost, fleet, random.Random(0))["r2"] == pytest.approx(50 / 60)


def test_the_home_over_the_load_bound_is_demoted() -> None:
    everywhere = {"r0": SYSTEM, "r1": SYSTEM}
    fleet = _fleet({"r0": 0.0, "r1": 400_000.0})  # past 131,072 + half of r0's load
    decision = build_policy("cache_aware").decide(_turn("r1", everywhere), fleet, random.Random(0))
    assert decision is not None and decision.ranking == ("r0", "r1")


def test_a_home_that_is_not_a_candidate_scores_nothing() -> None:
    fleet = _fleet({"r0": 0.0, "r1": 0.0})
    scores = ConversationScorer().score(_turn("gone", {}), fleet, random.Random(0))
    assert scores == {"r0": 0.0, "r1": 0.0}
    with pytest.raises(ValueError, match="affinity_weight must be non-negative"):
        RouterConfig(affinity_weight=-1.0)
