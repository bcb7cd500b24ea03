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
    for _ in range(120):  # one every 2 s for two whole windows: 30 per window
        rate = rates.observe(key)
        clock.now += 2
    assert rate.rate_per_min == pytest.approx(30, abs=1)
    clock.now += 15  # a quarter into the next window: 75% of the last one still counts
    assert rates.observe(key).rate_per_min == pytest.approx(30 * 0.75 + 1)
    clock.now += 120  # two windows of silence: young again, a single request has no rate yet
    assert rates.observe(key).rate_per_min == 1
    short = PrefixRates(window_s=10, clock=clock)  # ten seconds, scaled to a minute
    for _ in range(5):
        rate = short.observe(key)
        clock.now += 2
    assert rate.rate_per_min == 30  # 4 requests after the first in 8 s
    assert rates.observe(BlockHash(b"other")).k == 1


def test_a_burst_spreads_within_a_second_of_passing_the_threshold() -> None:
    """Item 18: a spine at 40 requests/s (300 own tokens each, engines at 13,000 prefill
    tokens/s: a threshold of ~780/min) stayed mostly on its holder for an 8-s burst, because
    2 s of requests divided by the 10-s window read as a fifth of the rate. Measured over the
    span it was seen, the rate passes the threshold within a second and k reaches the fleet
    within two."""
    clock = Clock()
    clock.now += 3.7  # anywhere in a window
    rates = PrefixRates(clock=clock)
    config = OverflowConfig(prefill_tokens_per_s=13_000)
    threshold = threshold_per_min(config, 330)
    key = BlockHash(b"spine")
    k, started, spread_at, full_at = 1, clock.now, None, None
    for _ in range(8 * 40):
        observed = rates.observe(key)
        k = next_k(observed.k, observed.rate_per_min, threshold, config.shrink_ratio, limit=4)
        rates.set_k(key, k)
        if k > 1 and spread_at is None:
            spread_at = clock.now - started
        if k == 4 and full_at is None:
            full_at = clock.now - started
        clock.now += 1 / 40
    assert spread_at is not None and spread_at <= 1.0
    assert full_at is not None and full_at <= 2.0
    assert k == 4  # and it stays spread for the rest of the burst


def test_a_steady_rate_below_the_threshold_never_spreads() -> None:
    """...without flapping: requests at 90% of the threshold, evenly spaced, for a minute."""
    clock = Clock()
    rates = PrefixRates(clock=clock)
    threshold = 600.0
    key = BlockHash(b"spine")
    ks = set()
    for _ in range(540):
        observed = rates.observe(key)
        k = next_k(observed.k, observed.rate_per_min, threshold, 0.7, limit=4)
        rates.set_k(key, k)
        ks.add(k)
        clock.now += 60 / 540
    assert ks == {1}


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


# -- issue 45, item 16: a fan-out burst is one arrival, widened only when its holder is full ----
def test_later_siblings_are_taken_back_from_the_rate_but_the_first_request_stays() -> None:
    clock = Clock()
    rates = PrefixRates(window_s=10.0, clock=clock)
    prefix = BlockHash(b"p" * 16)
    for _ in range(16):  # a burst of siblings in one instant...
        rates.observe(prefix)
    for _ in range(15):  # ...fifteen of which the placement finds are one flight's siblings
        rates.unobserve(prefix)
    rates.unobserve(prefix)  # never below the first request: the young rate's clock is there
    clock.now += 0.5
    assert rates.observe(prefix).rate_per_min == pytest.approx(60.0)  # two arrivals in 1 s
    clock.now += 20.0  # a later window: nothing of an older one is taken back
    rates.observe(prefix)
    rates.unobserve(prefix)
    assert rates.observe(prefix).rate_per_min > 0


def test_a_holder_has_room_until_its_measured_load_passes_the_bound() -> None:
    from router.fanout import holders_have_room
    from router.filters import LoadBoundFilter

    bound = LoadBoundFilter(absolute_slack_tokens=2_000, relative_slack=0.0)
    req = RouteRequest(num_blocks=60, num_prompt_tokens=15_100, overlap={"a": 58})
    idle = [Replica("a", True, 0, 0), Replica("b", True, 0, 0), Replica("c", True, 0, 0)]
    assert holders_have_room(req, idle, depth=58, bound=bound)
    # the holder's queue: 14 siblings' suffixes would not be enough to leave the bound...
    queued = [Replica("a", True, 14, 14 * 100), *idle[1:]]
    assert holders_have_room(req, queued, depth=58, bound=bound)
    # ...but a long prefill queued there is: then a sibling may widen the prefix
    busy = [Replica("a", True, 3, 40_000), *idle[1:]]
    assert not holders_have_room(req, busy, depth=58, bound=bound)
    # decode counts: thousands of output tokens still to generate on the holder
    decoding = [Replica("a", True, 8, 0, decode_tokens=8_000), *idle[1:]]
    weighted = RouteRequest(
        num_blocks=60, num_prompt_tokens=15_100, overlap={"a": 58}, decode_token_weight=4.0
    )
    assert not holders_have_room(weighted, decoding, depth=58, bound=bound)
    # nobody holds it (or the holder is down): no room to keep the siblings on
    assert not holders_have_room(req, [Replica("a", False, 0, 0), *idle[1:]], 58, bound)
