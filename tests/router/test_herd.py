"""Several gateways deciding one burst at once (issue 39, `router.herd`): a load tie is ranked
as the gateways' requests of that instant would be placed one after another in the order of
their ids. A gateway alone ranks exactly as before."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from router.registry import POLICIES, build_policy
from router.types import Replica, RouteRequest

IDS = ("r0", "r1", "r2", "r3")
SHARED = dict.fromkeys(IDS, 2)
"""Every replica holds the same two blocks (a shared system prompt): a tie but for the load."""


def fleet(*pending: float) -> list[Replica]:
    return [Replica(rid, True, 0, load) for rid, load in zip(IDS, pending, strict=True)]


def request(
    overlap: dict[str, int], blocks: int = 100, peers: int = 0, rank: int = 0
) -> RouteRequest:
    return RouteRequest(
        num_blocks=blocks,
        num_prompt_tokens=blocks * 64.0,
        overlap=overlap,
        tokens_per_block=64.0,
        peers=peers,
        peer_rank=rank,
    )


def choices(overlap: dict[str, int], replicas: list[Replica], gateways: int) -> list[str]:
    """The replica each of `gateways` gateways sends the request to, on the same view."""
    policy = build_policy("cache_aware")
    out = []
    for rank in range(gateways):
        req = request(overlap, peers=gateways - 1, rank=rank)
        decision = policy.decide(req, replicas, random.Random(rank))
        assert decision is not None
        out.append(decision.replica)
    return out


def test_four_gateways_deciding_at_once_send_new_prompts_to_four_replicas() -> None:
    # 6,272 tokens uncached each; the queues differ by less than that
    view = fleet(1_000.0, 2_000.0, 3_000.0, 4_000.0)
    alone = build_policy("cache_aware").decide(request(SHARED), view, random.Random(0))
    assert alone is not None and alone.replica == "r0"
    assert choices(SHARED, view, 4) == ["r0", "r1", "r2", "r3"]
    # what one gateway does with four such requests one after another
    placed, expected = list(view), []
    for _ in range(4):
        decision = build_policy("cache_aware").decide(request(SHARED), placed, random.Random(0))
        assert decision is not None
        expected.append(decision.replica)
        i = IDS.index(decision.replica)
        placed[i] = replace(
            placed[i], pending_prefill_tokens=placed[i].pending_prefill_tokens + 6_272
        )
    assert sorted(expected) == sorted(choices(SHARED, view, 4))


def test_a_replica_far_less_loaded_takes_every_gateways_request() -> None:
    """Three copies of the request fit under the others' queues: one gateway would send all
    four there too."""
    view = fleet(0.0, 100_000.0, 100_000.0, 100_000.0)
    assert choices(SHARED, view, 4) == ["r0"] * 4


def test_equal_queues_go_by_id_so_that_gateways_agree() -> None:
    view = fleet(500.0, 500.0, 500.0, 500.0)
    assert choices(SHARED, view, 4) == ["r0", "r1", "r2", "r3"]
    assert choices(SHARED, view, 2) == ["r0", "r1"]


def test_a_longer_cached_prefix_is_not_spread() -> None:
    """The rule ranks only a tie: the replica holding the conversation keeps every rank."""
    view = fleet(1_000.0, 2_000.0, 3_000.0, 4_000.0)
    held = {**SHARED, "r2": 60}
    assert choices(held, view, 4) == ["r2"] * 4


def test_a_tie_among_some_replicas_spreads_over_those_only() -> None:
    view = fleet(0.0, 1_000.0, 2_000.0, 3_000.0)
    held = {"r0": 2, "r1": 2, "r2": 50, "r3": 50}  # r2 and r3 tie at the longest match
    assert choices(held, view, 2) == ["r2", "r3"]
    assert choices(held, view, 4) == ["r2", "r3", "r2", "r3"]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_gateway_alone_ranks_exactly_as_before(name: str) -> None:
    """No peers: the rule does not run, whatever the rank says (and the rest of the router's
    tests, unchanged, hold the ranking itself)."""
    policy = build_policy(name)
    rng = random.Random(7)
    for _ in range(200):
        view = fleet(*(float(rng.choice((0, 500, 500, 9_000))) for _ in IDS))
        overlap = {rid: rng.choice((0, 2, 2, 40)) for rid in IDS}
        seed = rng.random()
        before = policy.decide(request(overlap), view, random.Random(seed))
        alone = policy.decide(request(overlap, rank=3), view, random.Random(seed))
        assert alone == before


@pytest.mark.parametrize("name", ["round_robin", "least_load", "random", "consistent_hash"])
def test_cache_blind_policies_do_not_spread(name: str) -> None:
    policy = build_policy(name)
    view = fleet(500.0, 500.0, 500.0, 500.0)
    for rank in range(4):
        with_peers = policy.decide(request(SHARED, peers=3, rank=rank), view, random.Random(1))
        alone = policy.decide(request(SHARED), view, random.Random(1))
        assert with_peers == alone
