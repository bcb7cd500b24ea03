"""When a turn stops waiting behind its previous turn queued at home (`router.claims`, issue 40):
the claim on the turn's home counts while the home's queue is at most half the turn's
re-prefill elsewhere. A narrative of one conversation's turn, then the properties that bound
the rule: it only ever takes claimed blocks away, a claim whole, never held ones, and never
touches a request without claims."""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from router.claims import counted_claims
from router.registry import build_policy
from router.types import Replica, RouteRequest

BLOCK = 16.0


def _turn() -> RouteRequest:
    """A 100-block turn (1,600 tokens): its home a holds 40 blocks by events and claims 60 more
    (its previous turn, placed there and still queued); b holds the 10-block system prompt.
    Elsewhere it would prefill (100 − 10) × 16 = 1,440 tokens."""
    return RouteRequest(
        100, 100 * BLOCK, {"a": 100, "b": 10}, tokens_per_block=BLOCK, claimed={"a": 60}, home="a"
    )


def test_the_claim_counts_while_the_queue_is_at_most_half_the_reprefill_elsewhere() -> None:
    turn = _turn()
    short = [Replica("a", pending_prefill_tokens=720.0), Replica("b")]
    assert counted_claims(turn, short) is turn  # 720 ≤ 1,440 / 2: the claim counts
    long = [Replica("a", pending_prefill_tokens=721.0), Replica("b")]
    moved = counted_claims(turn, long)
    assert moved.overlap == {"a": 40, "b": 10} and moved.claimed == {}
    # other gateways' queued work counts in the queue too
    foreign = Replica(
        "a", pending_prefill_tokens=500.0, engine_num_waiting=1, foreign_request_tokens=500.0
    )
    assert counted_claims(turn, [foreign, Replica("b")]).overlap["a"] == 40


def test_the_policy_decides_on_the_held_blocks_once_the_claim_does_not_count() -> None:
    """With the claim the home matches the whole turn; without it, 40 blocks against b's 10
    (the home still wins, on its held blocks): the load bound and scorers see what is held."""
    policy = build_policy("cache_aware")
    for queue, matched in ((500.0, 100), (2_000.0, 40)):
        replicas = [Replica("a", pending_prefill_tokens=queue), Replica("b")]
        decision = policy.decide(_turn(), replicas, random.Random(0))
        assert decision is not None and decision.replica == "a"
        assert decision.matched_blocks == matched


def test_a_claim_past_what_the_home_holds_is_dropped_whole() -> None:
    """A home holding nothing by events, with only a claim: gone from the overlap."""
    turn = RouteRequest(
        50, 50 * BLOCK, {"a": 50}, tokens_per_block=BLOCK, claimed={"a": 50}, home="a"
    )
    out = counted_claims(turn, [Replica("a", pending_prefill_tokens=1e6), Replica("b")])
    assert out.overlap == {} and out.claimed == {}
    # a caller that dropped the home's overlap (a suspect replica) but not its claim
    dropped = replace(turn, overlap={})
    assert counted_claims(dropped, [Replica("a", pending_prefill_tokens=1e6)]).claimed == {}


def test_a_claim_off_the_home_counts_by_the_queue_beyond_its_own_prefill() -> None:
    """A fan-out sibling's leader, another conversation sharing the prefix, or this
    conversation's turn placed there before it moved: its claim counts while what is queued
    there beyond the claimed prefill is at most ¾ of the re-prefill elsewhere (1,600 tokens here),
    as does every claim of a request without a home. Behind other sessions' prefills it does
    not: they run first and may evict the claimed blocks (issue 40, round 6)."""
    sibling = RouteRequest(
        100, 100 * BLOCK, {"a": 50}, tokens_per_block=BLOCK, claimed={"a": 50}, home="b"
    )
    own = 50 * BLOCK  # the leader's prefill, queued on a
    leading = [Replica("a", pending_prefill_tokens=own + 1_200.0), Replica("b")]
    assert counted_claims(sibling, leading) is sibling
    homeless = replace(sibling, home=None)
    assert counted_claims(homeless, leading) is homeless
    behind = [Replica("a", pending_prefill_tokens=own + 1_201.0), Replica("b")]
    for req in (sibling, homeless):
        out = counted_claims(req, behind)
        assert out.overlap == {} and out.claimed == {}


@settings(max_examples=200, deadline=None)
@given(
    held=st.dictionaries(st.sampled_from("abc"), st.integers(0, 50), max_size=3),
    claims=st.dictionaries(st.sampled_from("abc"), st.integers(1, 50), max_size=3),
    queues=st.lists(st.floats(0, 5_000), min_size=3, max_size=3),
    home=st.sampled_from(["a", "b", "c", None]),
)
def test_a_claim_counts_whole_or_not_at_all_and_held_blocks_stay(
    held: dict[str, int], claims: dict[str, int], queues: list[float], home: str | None
) -> None:
    overlap = {r: held.get(r, 0) + claims.get(r, 0) for r in {*held, *claims}}
    overlap = {r: n for r, n in overlap.items() if n > 0}
    turn = RouteRequest(
        100, 100 * BLOCK, overlap, tokens_per_block=BLOCK, claimed=claims, home=home
    )
    replicas = [Replica(r, pending_prefill_tokens=q) for r, q in zip("abc", queues, strict=True)]
    out = counted_claims(turn, replicas)
    for r in "abc":
        kept = out.overlap.get(r, 0)
        assert kept in (held.get(r, 0), overlap.get(r, 0))
        assert out.claimed.get(r, 0) == kept - held.get(r, 0)
    plain = RouteRequest(100, 100 * BLOCK, {r: n for r, n in held.items() if n}, BLOCK, home=home)
    assert counted_claims(plain, replicas) is plain
