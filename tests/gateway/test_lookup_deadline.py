"""The shared lookup's deadline (`gateway.deadline.LookupDeadline`): the base until
enough round trips are in, then twice their p99, never below the base nor above the cap."""

from __future__ import annotations

import pytest

from gateway.deadline import MIN_SAMPLES, RECOMPUTE_EVERY, WINDOW, LookupDeadline


def test_the_deadline_follows_the_recent_p99_between_the_base_and_the_cap() -> None:
    d = LookupDeadline(base_s=0.005, per_block_s=20e-6, cap_s=0.025)
    assert d.seconds(0) == 0.005
    assert d.seconds(100) == pytest.approx(0.005 + 0.002)
    for _ in range(MIN_SAMPLES - 1):  # too few to trust: still the base
        d.observe(0.008)
    assert d.seconds(0) == 0.005
    d.observe(0.008)
    assert d.seconds(0) == pytest.approx(0.016)  # twice the p99
    for _ in range(WINDOW):  # a fast Redis: the base is the floor
        d.observe(0.0002)
    assert d.seconds(0) == 0.005
    for _ in range(WINDOW):  # a slow one: the cap is the ceiling
        d.observe(0.1)
    assert d.seconds(10) == pytest.approx(0.025 + 10 * 20e-6)


def test_a_few_slow_round_trips_in_the_window_are_the_p99() -> None:
    """1% of the window slow is the p99 (queued behind writes): the deadline lets it answer."""
    d = LookupDeadline(base_s=0.005, per_block_s=0.0, cap_s=0.025)
    for i in range(WINDOW):
        d.observe(0.009 if i % 50 == 0 else 0.0005)  # 2% at 9 ms
    assert d.p99_s == 0.009
    assert d.seconds(0) == pytest.approx(0.018)
    assert WINDOW % RECOMPUTE_EVERY == 0


def test_a_base_above_the_cap_is_the_deadline() -> None:
    """An operator's larger base wins over the cap (the chaos suite's 50 ms)."""
    d = LookupDeadline(base_s=0.05, per_block_s=0.0, cap_s=0.025)
    for _ in range(WINDOW):
        d.observe(0.2)
    assert d.seconds(0) == 0.05
    with pytest.raises(ValueError, match="cap must be positive"):
        LookupDeadline(0.005, 0.0, 0.0)
