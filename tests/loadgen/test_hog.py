"""The bench's hog (`kind:policy~P`): it takes about the share of a core it is given, spread
over its run, and stops when the bench's block ends."""

from __future__ import annotations

import time

from loadgen.bench.hog import hogging


def test_the_hog_takes_its_share_of_a_core_and_stops_with_the_block() -> None:
    with hogging(30) as spent:
        start = time.perf_counter()
        # wall time for the hog to run in: a bounded wait, not synchronisation
        time.sleep(1.0)
        wall = time.perf_counter() - start
    assert len(spent) == 1  # the block's end read its CPU and stopped it
    # /proc counts 10-ms ticks; a loaded machine may give the hog less than it asks, never more
    assert 0.1 * wall <= spent[0] <= 0.45 * wall


def test_no_hog_at_zero() -> None:
    with hogging(0) as spent:
        pass
    assert spent == []
