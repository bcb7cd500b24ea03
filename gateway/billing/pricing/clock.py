"""The meter's clock: unix seconds as exact Decimals, injectable for tests and replays.

The live meter reads `meter.clock.now()` at a request's start (the request hook, before routing)
and at its first token (when its entries become visible). A test swaps in a `ManualClock`
through `app.state.billing.meter.clock` and drives time explicitly: every instant read while
the clock stands still is the same instant, so a request sent at `clock.set(898)` starts at
exactly 898 s.
"""

from __future__ import annotations

import time
from decimal import Decimal
from typing import Protocol

from gateway.billing.pricing.money import dec

_NANOS = Decimal(1_000_000_000)


class Clock(Protocol):
    def now(self) -> Decimal: ...


class WallClock:
    """The system's real-time clock (nanosecond resolution, exact in Decimal)."""

    def now(self) -> Decimal:
        return Decimal(time.time_ns()) / _NANOS


class ManualClock:
    """A clock that moves only when told to. Invariant: it never goes backwards."""

    def __init__(self, start: Decimal | int | str = 0) -> None:
        self._now = dec(start)

    def now(self) -> Decimal:
        return self._now

    def set(self, instant: Decimal | int | str) -> None:
        value = dec(instant)
        if value < self._now:
            raise ValueError(f"a manual clock never goes backwards ({value} < {self._now})")
        self._now = value

    def advance(self, seconds: Decimal | int | str) -> None:
        self.set(self._now + dec(seconds))
