"""The decode pick of a P/D fleet: load first, the instance's own prefix within the bound."""

from __future__ import annotations

import random

from router.pd import DECODE_INFLIGHT_TOKENS, decode_load, rank_decode
from router.types import Replica


def test_within_the_bound_the_longest_cached_prefix_wins() -> None:
    replicas = [Replica("a", decode_tokens=100.0), Replica("b", decode_tokens=200.0)]
    # b is busier, but within 25% + 256 tokens of a, and holds the conversation's prefix
    assert rank_decode(replicas, {"b": 40, "a": 2}, random.Random(0)) == ["b", "a"]


def test_beyond_the_bound_load_wins_whatever_is_cached() -> None:
    replicas = [Replica("a", decode_tokens=100.0), Replica("b", decode_tokens=2_000.0)]
    assert rank_decode(replicas, {"b": 40}, random.Random(0)) == ["a", "b"]


def test_requests_in_flight_count_as_load_and_the_unhealthy_are_left_out() -> None:
    busy = Replica("a", num_inflight=20)
    assert decode_load(busy) == 20 * DECODE_INFLIGHT_TOKENS
    replicas = [busy, Replica("b"), Replica("c", healthy=False)]
    assert rank_decode(replicas, {"a": 40}, random.Random(0)) == ["b", "a"]
    assert rank_decode([Replica("c", healthy=False)], {}, random.Random(0)) == []


def test_ties_are_broken_at_random() -> None:
    replicas = [Replica("a"), Replica("b")]
    firsts = {rank_decode(replicas, {}, random.Random(seed))[0] for seed in range(20)}
    assert firsts == {"a", "b"}
