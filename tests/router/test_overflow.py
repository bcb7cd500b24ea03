"""Hot prefixes: rates against a controlled clock, k with hysteresis, the spread."""

from __future__ import annotations

import pytest

from cachemap.keys import BlockHash
from cachemap.rates import PrefixRates
from router.overflow import OverflowConfig, next_k, spread, threshold_per_min
from router.types import Replica, RouteRequest


class Clock:
    def __init__(self) -> None:
        self.now = 6_000.0  # the start of a 60-s window

    def __call__(self) -> float:
        return self.now


def test_the_rate_is_a_sliding_window_per_minute() -> None:
    clock = Clock()
    rates = PrefixRates(window_s=60, clock=clock)
    key = BlockHash(b"spine")
    for _ in range(30):
        rate = rates.observe(key)
    assert rate.rate_per_min == 30
    clock.now += 60 + 15  # a quarter into the next window: 75% of the last one still counts
    assert rates.observe(key).rate_per_min == pytest.approx(30 * 0.75 + 1)
    clock.now += 120  # two windows of silence
    assert rates.observe(key).rate_per_min == 1
    short = PrefixRates(window_s=10, clock=clock)  # ten seconds, scaled to a minute
    for _ in range(5):
        rate = short.observe(key)
    assert rate.rate_per_min == 30
    assert rates.observe(BlockHash(b"other")).k == 1


def test_the_threshold_comes_from_the_prefill_capacity() -> None:
    config = OverflowConfig(prefill_tokens_per_s=10_000, hot_share=0.5)
    # 1,000 uncached tokens = 0.1 s of prefill; half a replica = 300 requests a minute
    assert threshold_per_min(config, 1_000) == pytest.approx(300)
    # very long suffixes never push the threshold below the floor
    assert threshold_per_min(config, 10_000_000) == 15.0


def test_k_grows_at_once_and_shrinks_one_step_below_the_band() -> None:
    threshold, shrink = 100.0, 0.7
    k = 1
    timeline = []
    for rate in (50, 150, 420, 390, 300, 220, 200, 139, 120, 69, 10):
        k = next_k(k, rate, threshold, shrink, limit=8)
        timeline.append(k)
    # up at once: 150 → 2, 420 → 5. Down one step only below (k−1)·100·0.7: at k=5 that is
    # 280 (390 and 300 stay, 220 → 4); at 4, 210 (200 → 3); at 3, 140 (139 → 2); at 2, 70
    # (120 stays, 69 → 1).
    assert timeline == [1, 2, 5, 5, 5, 4, 3, 2, 2, 1, 1]
    assert next_k(1, 10_000, threshold, shrink, limit=3) == 3  # never more than the replicas


def test_no_flapping_at_the_edge() -> None:
    k, seen = 1, set()
    for rate in (101, 99, 101, 99, 101, 99):
        k = next_k(k, rate, 100.0, 0.7, limit=8)
        seen.add(k)
    assert seen == {2}


def test_a_controlled_clock_drives_widening_and_shrinking() -> None:
    clock = Clock()
    rates = PrefixRates(clock=clock)
    key = BlockHash(b"spine")
    k, history = 1, []
    for rate_per_min, minutes in ((60, 2), (360, 3), (60, 4)):
        for _ in range(rate_per_min * minutes):
            clock.now += 60 / rate_per_min
            observed = rates.observe(key)
            k = next_k(observed.k, observed.rate_per_min, 100.0, 0.7, limit=8)
            rates.set_k(key, k)
        history.append(k)
    assert history == [1, 4, 1]


def test_spread_adds_the_least_loaded_non_holders() -> None:
    replicas = [Replica("a", True, 0, 5000), Replica("b", True, 0, 100), Replica("c", True, 0, 0)]
    req = RouteRequest(num_blocks=20, num_prompt_tokens=1280, overlap={"a": 12})
    same, added = spread(req, replicas, depth=12, k=1)
    assert same is req and added == []
    widened, added = spread(req, replicas, depth=12, k=2)
    assert added == ["c"]
    assert widened.overlap == {"a": 12, "c": 12}
    deeper = RouteRequest(num_blocks=20, num_prompt_tokens=1280, overlap={"a": 12, "b": 18})
    widened, added = spread(deeper, replicas, depth=12, k=3)
    assert widened.overlap == {"a": 12, "b": 18, "c": 12}  # b's deeper match is kept
