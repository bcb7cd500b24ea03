"""The shared routing step: a hot prefix widened, then the policy — what the gateway's placement
and `kvgate sim` both run."""

from __future__ import annotations

import random

from router.overflow import OverflowConfig
from router.plan import HotPrefix, plan
from router.registry import build_policy
from router.types import Replica, RouteRequest

REPLICAS = [Replica("a", True, 0, 0.0), Replica("b", True, 0, 0.0), Replica("c", True, 0, 0.0)]
ROUTE = RouteRequest(num_blocks=20, num_prompt_tokens=1280, overlap={"a": 16}, tokens_per_block=64)
# 256 uncached tokens at 10,000 tokens/s, half a replica each: 1,171.9 requests a minute
OVERFLOW = OverflowConfig(prefill_tokens_per_s=10_000, hot_share=0.5)


def test_without_a_hot_prefix_the_plan_is_the_policys_decision() -> None:
    policy = build_policy("cache_aware")
    planned = plan(policy, ROUTE, REPLICAS, random.Random(1))
    assert planned.decision == policy.decide(ROUTE, REPLICAS, random.Random(1))
    assert planned.route is ROUTE and planned.k is None and not planned.spread
    assert planned.decision is not None and planned.decision.replica == "a"


def test_a_prefix_over_its_threshold_spreads_and_reports_its_new_k() -> None:
    policy = build_policy("cache_aware")
    cool = plan(policy, ROUTE, REPLICAS, random.Random(1), HotPrefix(100.0, 1), OVERFLOW)
    assert cool.k == 1 and not cool.spread and cool.route.overlap == {"a": 16}
    hot = plan(policy, ROUTE, REPLICAS, random.Random(1), HotPrefix(2_500.0, 1), OVERFLOW)
    assert hot.k == 3 and hot.spread  # ceil(2,500 / 1,171.9) = 3 replicas
    assert hot.route.overlap == {"a": 16, "b": 16, "c": 16}
    assert hot.decision is not None and hot.decision.replica in {"a", "b", "c"}


def test_a_fixed_threshold_overrides_the_one_the_prefix_size_implies() -> None:
    policy = build_policy("cache_aware")
    fixed = OverflowConfig(prefill_tokens_per_s=10_000, fixed_threshold_per_min=50.0)
    planned = plan(policy, ROUTE, REPLICAS, random.Random(1), HotPrefix(120.0, 1), fixed)
    assert planned.k == 3  # ceil(120 / 50)
