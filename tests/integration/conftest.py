"""The Redis integration tests end with every connection they opened closed.

A connection left open — a background flush still running when the test's loop closes, say —
is only reported when the garbage collector reaches it, as a ResourceWarning, and the suite
turns warnings into errors: the error then lands on whichever later test is running, on one
run in many. Collecting after each test here reports it every time, on the test that left it
or the next one (its loop is closed after this fixture's teardown): a suite run failed
`test_frontiers_redis.py::test_a_moving_order_...[cluster]` for a socket of the `[redis]` run
before it, whose wipe's background flush opened a connection after the client had closed."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _collect_what_the_test_left() -> Iterator[None]:
    yield
    gc.collect()
