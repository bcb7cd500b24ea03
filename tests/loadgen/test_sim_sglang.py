"""The simulator's model of sglang-router's `cache_aware` (`loadgen.sim.SglangModel`), and
bench point 2 in virtual time: kvgate's `cache_aware` against it on the same trace."""

from __future__ import annotations

from cachemap.keys import BlockHash
from loadgen.sim import SGLANG_MODEL, SglangModel, SimConfig, at_utilization, run_policies
from loadgen.traces import CONVERSATION_TRACE
from loadgen.traces.readers import read_trace


def _hashes(*ids: int) -> list[BlockHash]:
    return [BlockHash(i.to_bytes(8, "big")) for i in ids]


def test_the_three_branches_of_sglang_routers_cache_aware() -> None:
    model = SglangModel(["r0", "r1", "r2"])
    idle = {"r0": 0, "r1": 0, "r2": 0}
    # nothing in any tree: the smallest tree (all empty: the first by id)
    assert model.decide(_hashes(1, 2, 3, 4), idle, 4 * 16, 16).ranking[0] == "r0"
    # the same prefix, 3 of 4 blocks (75% > 30%): the worker whose tree holds it
    first = model.decide(_hashes(1, 2, 3, 9), idle, 4 * 16, 16)
    assert (first.ranking[0], first.reason) == ("r0", "prefix")
    # 1 block of 4 (25% <= 30%): the smallest tree, not the match
    small = model.decide(_hashes(1, 7, 8, 10), idle, 4 * 16, 16)
    assert (small.ranking[0], small.reason) == ("r1", "no_match")
    # imbalanced (100 - 10 > 64 and 100 > 1.5 x 10): the fewest in flight, whatever the match
    busy = {"r0": 100, "r1": 50, "r2": 10}
    queue = model.decide(_hashes(1, 2, 3, 4), busy, 4 * 16, 16)
    assert (queue.ranking[0], queue.reason) == ("r2", "shortest_queue")
    # a gap of 64 is not imbalanced: the match again
    even = {"r0": 74, "r1": 50, "r2": 10}
    assert model.decide(_hashes(1, 2, 3, 4), even, 4 * 16, 16).ranking[0] == "r0"


def test_bench_point_2_cache_aware_balances_no_worse_than_sglang_routers_policy() -> None:
    """Bench point 2 (the slice's first 1,000 requests, 4 engines, 10% KV, prefill 85% busy
    under round robin) in virtual time: kvgate's `cache_aware` placed every request no worse
    than the model of sglang-router's policy: its TTFT lower (mean 3.24 against 3.45 trace s, p99
    11.8 against 12.3 when written), its hit ratio within 5% (0.049 against 0.051): the load
    balancing alone (docs/design/routing.md, "Bench point 2: TTFT against sglang-router")."""
    trace = read_trace(CONVERSATION_TRACE, start=4000, limit=1000)
    config = SimConfig(num_replicas=4, capacity_frac=0.10, max_output_tokens=64)
    config = at_utilization(trace, config, 0.85)
    _, results = run_policies(trace, ["cache_aware", SGLANG_MODEL], config)
    by = {r.policy: r for r in results}
    ours, peer = by["cache_aware"], by[SGLANG_MODEL]
    assert ours.requests == peer.requests == 1000
    assert ours.hit_ratio >= 0.95 * peer.hit_ratio
    assert ours.ttft_mean_s < peer.ttft_mean_s
    assert ours.ttft_p99_s < peer.ttft_p99_s
    # most of sglang-router's decisions are the smallest tree: its match rarely covers 30%
    assert peer.decisions["no_match"] > peer.decisions["prefix"]
