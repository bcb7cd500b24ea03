"""When the shared directory is treated as away, and how it comes back.

    healthy ──DEGRADE_AFTER consecutive failed lookups──▶ degraded ──a probe answers──▶ healthy
                                                            │
                                 the request path stops asking Redis; a background probe pings
                                 it every PROBE_INTERVAL_S (and refreshes the generations)

Consecutive means one after another: a failed lookup counts only if it started after the last
failure counted. Lookups in flight together that fail together (one stall: the gateway or Redis
descheduled on a loaded machine, a Redis pause) are one failure, not DEGRADE_AFTER of them; a
Redis that is really away fails the lookups sent after the first failure too.

Each change of state is logged once, at WARNING, and counted. Coming back calls `on_back` with
the wall-clock time the outage began (what Redis may have missed since: `restore.WriteBack`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.tasks import BackgroundTasks

log = logging.getLogger(__name__)

DEGRADE_AFTER = 3
"""Consecutive failed lookups before the gateway stops trying Redis on the request path: one
slow reply on a busy machine is not an outage."""
PROBE_INTERVAL_S = 0.5
"""How often a degraded gateway pings Redis to come back."""


@dataclass
class BreakerState:
    degraded: bool = False
    state_changes: int = 0
    consecutive_failures: int = 0
    degraded_since_s: float | None = None
    """Wall-clock time the current outage began (None while healthy)."""
    last_failure_s: float = -math.inf
    """`time.perf_counter()` when the last counted failure was noticed."""


class Breaker:
    def __init__(self, probe: Callable[[], Awaitable[None]], tasks: BackgroundTasks) -> None:
        """`probe` raises while the shared directory is away and returns once it answers."""
        self.state = BreakerState()
        self._probe = probe
        self._tasks = tasks
        self.on_back: Callable[[float], None] | None = None

    @property
    def degraded(self) -> bool:
        return self.state.degraded

    def succeeded(self) -> None:
        self.state.consecutive_failures = 0

    def failed(self, exc: BaseException, started_s: float) -> None:
        """A lookup that began at `started_s` (`time.perf_counter()`) failed; it counts unless
        it was already in flight when the last counted failure was noticed (the same stall)."""
        log.debug("shared lookup failed: %r", exc)
        state = self.state
        if started_s < state.last_failure_s:
            return
        state.last_failure_s = time.perf_counter()
        state.consecutive_failures += 1
        if state.consecutive_failures >= DEGRADE_AFTER and not state.degraded:
            reason = (
                "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
            )
            self.degrade(f"{state.consecutive_failures} lookups failed ({reason})")

    def degrade(self, why: str) -> None:
        """Stop using the shared directory until a probe answers."""
        if self._set(True, why):
            self._tasks.spawn(self._probe_until_back(), name="directory probe")

    def _set(self, degraded: bool, why: str) -> bool:
        state = self.state
        if degraded == state.degraded:
            return False
        state.degraded = degraded
        state.state_changes += 1
        if degraded:
            state.degraded_since_s = time.time()
            log.warning("shared directory degraded, routing locally: %s", why)
        else:
            since, state.degraded_since_s = state.degraded_since_s, None
            log.warning("shared directory back: %s", why)
            if self.on_back is not None and since is not None:
                self.on_back(since)
        return True

    async def _probe_until_back(self) -> None:
        while self.state.degraded:
            await asyncio.sleep(PROBE_INTERVAL_S)
            try:
                await self._probe()
            except asyncio.CancelledError:
                raise
            except Exception:
                continue
            self.state.consecutive_failures = 0
            self._set(False, "Redis answers again")
