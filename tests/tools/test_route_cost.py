"""`tools.route_cost`, small: it runs, and the fleet it times decides as the profile's parts
do when each computes its own values (the memo changes the cost, not the choice)."""

from __future__ import annotations

import random

import pytest

from router.registry import build_policy
from tools import route_cost


def test_it_prints_both_policies_at_every_size(capsys: pytest.CaptureFixture[str]) -> None:
    route_cost.run([2, 5], calls=10)
    out = capsys.readouterr().out
    assert "10 decisions per arm" in out
    assert "   2 replicas: cache_aware" in out and "   5 replicas: cache_aware" in out
    assert out.count("cache_pressure") == 2 and out.count("frontiers") == 2


def test_a_decision_ranks_as_before_at_fleet_size() -> None:
    """64 replicas with queues and frontiers: the memoised decision is the one the profile's
    parts give when each computes its own values (the ranking of the first group)."""
    replicas = route_cost.fleet(64, frontiers=True)
    req = route_cost.request(replicas)
    profile = build_policy("cache_pressure")
    decision = profile.decide(req, replicas, random.Random(3))
    assert decision is not None
    eligible = profile.filters[-1].filter(req, replicas)  # the load bound
    rng = random.Random(3)
    total = {r.id: 0.0 for r in eligible}
    for scorer, weight in profile.scorers:
        for rid, value in scorer.score(req, eligible, rng).items():
            total[rid] += weight * min(max(value, 0.0), 1.0)
    best = max(total.values())
    assert total[decision.replica] == best
