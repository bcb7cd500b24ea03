"""A block held only off the GPU (known from KV events) is a hit that costs `offload_cost` of
its prefill: `cache_aware` ranks it below a GPU hit and above a miss."""

from __future__ import annotations

import random

from router.registry import build_policy
from router.types import Replica, RouteRequest

REPLICAS = [Replica("cpu"), Replica("gpu"), Replica("miss")]


def route(**kw: object) -> RouteRequest:
    return RouteRequest(
        num_blocks=64,
        num_prompt_tokens=1024.0,
        overlap={"cpu": 64, "gpu": 64},
        tokens_per_block=16.0,
        offloaded={"cpu": 64},
        offload_cost=0.07,
        **kw,  # type: ignore[arg-type]
    )


def test_a_cpu_hit_ranks_below_a_gpu_hit_and_above_a_miss() -> None:
    policy = build_policy("cache_aware")
    for seed in range(20):  # ties would be broken at random: there are none
        decision = policy.decide(route(), REPLICAS, random.Random(seed))
        assert decision is not None and decision.ranking == ("gpu", "cpu", "miss")
    req = route()
    assert req.uncached_tokens("gpu") == 0.0
    assert req.uncached_tokens("cpu") == 0.07 * 1024  # loading back 1,024 tokens over PCIe
    assert req.uncached_tokens("miss") == 1024.0


def test_without_tiers_nothing_changes() -> None:
    req = RouteRequest(
        num_blocks=4, num_prompt_tokens=256.0, overlap={"a": 2}, tokens_per_block=64.0
    )
    assert req.uncached_tokens("a") == 128.0 and req.offloaded == {}
