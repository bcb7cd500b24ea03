"""The hottest prefixes without a scan: /metrics re-rates a bounded set of candidates, never
the whole table, and still names the right prefixes in the right order."""

from __future__ import annotations

from cachemap.keys import BlockHash
from cachemap.rates import HOT_CANDIDATES, PrefixRates


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def key(name: str) -> BlockHash:
    return BlockHash(name.encode())


def test_the_hottest_among_20k_prefixes_from_a_bounded_set_of_candidates() -> None:
    clock = Clock()
    rates = PrefixRates(clock=clock)
    hot = [key(f"hot-{i}") for i in range(5)]
    for n in range(20_000):
        rates.observe(key(f"cold-{n}"))  # each seen once
        if n % 200 == 0:
            for i, prefix in enumerate(hot):  # hot-0 the hottest, hot-4 the least hot
                for _ in range(5 - i):
                    rates.observe(prefix)
        clock.now += 0.0002  # 20,000 requests in 4 s: all in one window
    assert rates.num_candidates <= HOT_CANDIDATES
    top = rates.hottest(5)
    assert [prefix for prefix, _ in top] == hot
    # each hot prefix is young (first seen 4 s ago, within the two windows): its rate is
    # measured over the span observed, (requests - 1) per 4 s: hot-0's 500 requests are 7,485/min
    assert [round(r.rate_per_min) for _, r in top] == [
        round((100 * (5 - i) - 1) * 60 / 4.0) for i in range(5)
    ]


def test_a_candidate_that_cooled_makes_room_for_the_next_riser() -> None:
    clock = Clock()
    rates = PrefixRates(clock=clock)
    for i in range(HOT_CANDIDATES):  # a full set of candidates, each at 60 requests/window
        for _ in range(60):
            rates.observe(key(f"burst-{i}"))
    clock.now += 25  # two windows later all of them are cold
    for _ in range(3):
        rates.observe(key("riser"))  # 120/min young (2 per the 1-s minimum span): below every
        # stale candidate's last rate (59 per second: 3,540/min)
    assert key("riser") not in [p for p, _ in rates.hottest(HOT_CANDIDATES)]
    # that scrape re-rated the candidates (0/min now): the riser's next request joins them
    rates.observe(key("riser"))
    top = rates.hottest(1)
    # young: 3 requests after its first, over the 1-s minimum span
    assert top[0][0] == key("riser") and round(top[0][1].rate_per_min) == 3 * 60
