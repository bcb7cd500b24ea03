"""Routing policies as narrative tests with exact outcomes."""

from __future__ import annotations

import random

import pytest

from router.filters import DEFAULT_DECODE_TOKEN_WEIGHT, LoadBoundFilter
from router.registry import POLICIES, RouterConfig, build_policy
from router.types import Replica, RouteRequest

IDS = ("r0", "r1", "r2", "r3")


def fleet(**pending: float) -> list[Replica]:
    return [Replica(rid, True, 0, pending.get(rid, 0.0)) for rid in IDS]


def request(
    overlap: dict[str, int], blocks: int = 100, tokens_per_block: float = 64.0
) -> RouteRequest:
    return RouteRequest(
        num_blocks=blocks,
        num_prompt_tokens=blocks * tokens_per_block,
        overlap=overlap,
        tokens_per_block=tokens_per_block,
    )


def test_cache_aware_picks_the_longest_match() -> None:
    policy = build_policy("cache_aware")
    decision = policy.decide(request({"r1": 40, "r2": 90}), fleet(), random.Random(0))
    assert decision is not None
    assert decision.replica == "r2"
    assert decision.reason == "prefix"
    assert decision.matched_blocks == 90
    assert decision.ranking[:2] == ("r2", "r1")
    # the receipt's numbers: the policy, and a score per ranked replica, best first
    assert decision.policy == "cache_aware" and len(decision.scores) == len(IDS)
    assert decision.scores[0] > decision.scores[1] > decision.scores[2]


def test_the_best_match_is_passed_over_exactly_when_it_is_over_the_load_bound() -> None:
    config = RouterConfig(absolute_slack_tokens=10_000, relative_slack=0.0)
    policy = build_policy("cache_aware", config)
    req = request({"r2": 90})  # 6,400 tokens; 640 uncached on r2, 6,400 elsewhere
    # least work elsewhere is 6,400; the bound is 16,400. r2's work is pending + 640.
    at_bound = policy.decide(req, fleet(r2=15_760), random.Random(0))
    assert at_bound is not None and at_bound.replica == "r2" and at_bound.reason == "prefix"
    over = policy.decide(req, fleet(r2=15_761), random.Random(0))
    assert over is not None and over.replica != "r2" and over.reason == "load_bound"
    assert over.ranking[-1] == "r2"  # demoted, still a fallback for retries
    assert len(over.scores) == len(over.ranking)  # r2 scored within the demoted group


def test_decode_still_running_counts_in_the_bound() -> None:
    """Item 19: the holder of a shared system prompt kept every request while its prefill
    queue stayed short, however many streams it was still decoding (205 of 210 on one of 4
    engines). Outstanding output tokens count in the load, weighted in prefill tokens."""
    req = request({"r0": 90})  # 6,400 tokens; 640 uncached on r0, 6,400 elsewhere
    weighted = RouteRequest(
        req.num_blocks,
        req.num_prompt_tokens,
        req.overlap,
        req.tokens_per_block,
        decode_token_weight=DEFAULT_DECODE_TOKEN_WEIGHT,
    )
    policy = build_policy("cache_aware")

    def decoding(r0_tokens: float, **others: Replica) -> list[Replica]:
        fleet = [Replica("r0", decode_tokens=r0_tokens), Replica("r1"), Replica("r2")]
        return [others.get(r.id, r) for r in fleet]

    # 8 streams with 1,000 tokens to go: 640 + 4 × 8,000 = 32,640, within 6,400 + 131,072 +
    # 3,200 = 140,672 of the others: the prefix wins
    kept = policy.decide(weighted, decoding(8_000), random.Random(0))
    assert kept is not None and kept.replica == "r0" and kept.reason == "prefix"
    # 40 such streams: 160,640 > 140,672, over the bound: the least-loaded other replica
    moved = policy.decide(weighted, decoding(40_000), random.Random(0))
    assert moved is not None and moved.replica != "r0" and moved.reason == "load_bound"
    # without the weight (decode not counted) the holder kept everything
    blind = policy.decide(req, decoding(40_000), random.Random(0))
    assert blind is not None and blind.replica == "r0"
    # other gateways' streams, seen as the engine's running requests beyond this gateway's
    # own: 36 foreign at a mean of 1,000 tokens + 4,000 of its own = 40,000 again
    foreign = Replica(
        "r0",
        decode_tokens=4_000,
        engine_num_running=40,
        own_num_running=4,
        request_output_tokens=1_000,
    )
    assert foreign.decode_work_tokens == 40_000
    seen = policy.decide(weighted, decoding(0, r0=foreign), random.Random(0))
    assert seen is not None and seen.reason == "load_bound"


def test_the_relative_slack_widens_the_bound_under_load() -> None:
    bound = LoadBoundFilter(absolute_slack_tokens=1000, relative_slack=0.5)
    req = request({}, blocks=10)  # 640 tokens, nothing cached
    busy = [Replica(rid, True, 0, 20_000.0) for rid in IDS]
    # least work = 20,640; bound = 20,640 + 1,000 + 10,320
    assert bound.bound(req, busy) == pytest.approx(31_960)


def test_no_match_goes_to_the_least_loaded() -> None:
    policy = build_policy("cache_aware")
    decision = policy.decide(request({}), fleet(r0=500, r1=100, r2=900, r3=300), random.Random(0))
    assert decision is not None
    assert decision.replica == "r1"
    assert decision.reason == "no_match"


def test_unhealthy_replicas_are_never_ranked() -> None:
    replicas = [Replica("r0", False), Replica("r1", True)]
    decision = build_policy("cache_aware").decide(request({"r0": 100}), replicas, random.Random(0))
    assert decision is not None and decision.ranking == ("r1",)
    none = build_policy("round_robin").decide(request({}), [Replica("r0", False)], random.Random(0))
    assert none is None


def test_round_robin_cycles_in_id_order() -> None:
    policy = build_policy("round_robin")
    picks = []
    for seq in range(6):
        req = RouteRequest(num_blocks=1, num_prompt_tokens=64, sequence=seq)
        decision = policy.decide(req, list(reversed(fleet())), random.Random(0))
        assert decision is not None
        picks.append(decision.replica)
    assert picks == ["r0", "r1", "r2", "r3", "r0", "r1"]


def test_least_load_picks_fewest_in_flight_and_ignores_the_cache() -> None:
    replicas = [Replica("r0", True, 3), Replica("r1", True, 1), Replica("r2", True, 2)]
    decision = build_policy("least_load").decide(request({"r0": 100}), replicas, random.Random(0))
    assert decision is not None and decision.ranking == ("r1", "r2", "r0")


def test_consistent_hash_is_stable_and_moves_only_the_keys_of_a_leaving_replica() -> None:
    policy = build_policy("consistent_hash")
    keys = [f"key{i}".encode() for i in range(400)]

    def owner(key: bytes, replicas: list[Replica]) -> str:
        decision = policy.decide(
            RouteRequest(num_blocks=4, num_prompt_tokens=256, affinity_key=key),
            replicas,
            random.Random(0),
        )
        assert decision is not None
        return decision.replica

    before = {k: owner(k, fleet()) for k in keys}
    assert len(set(before.values())) == 4
    assert before == {k: owner(k, fleet()) for k in keys}
    without_r3 = [r for r in fleet() if r.id != "r3"]
    after = {k: owner(k, without_r3) for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != "r3")


def test_random_is_reproducible_with_a_seed() -> None:
    policy = build_policy("random")
    first = [policy.decide(request({}), fleet(), random.Random(42)) for _ in range(3)]
    second = [policy.decide(request({}), fleet(), random.Random(42)) for _ in range(3)]
    assert first == second


def test_ties_between_equal_matches_go_to_less_work_then_at_random() -> None:
    policy = build_policy("cache_aware")
    decision = policy.decide(request({"r1": 50, "r3": 50}), fleet(r1=300), random.Random(0))
    assert decision is not None and decision.replica == "r3"
    winners = {
        d.replica
        for seed in range(20)
        if (d := policy.decide(request({"r1": 50, "r3": 50}), fleet(), random.Random(seed)))
    }
    assert winners == {"r1", "r3"}


def test_unknown_policy_names_the_options() -> None:
    with pytest.raises(
        ValueError,
        match="cache_aware, cache_pressure, round_robin, random, least_load, consistent_hash",
    ):
        build_policy("fastest")
    assert set(POLICIES) == {
        "cache_aware",
        "cache_pressure",
        "round_robin",
        "random",
        "least_load",
        "consistent_hash",
    }
