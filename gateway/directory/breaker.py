"""When the shared directory is treated as away, and how it comes back.

    healthy ──DEGRADE_AFTER consecutive failed lookups──▶ degraded ──RECOVER_AFTER good──▶ healthy
                                                            │          probes in a row
                                 the request path stops asking Redis; a background probe runs
                                 every PROBE_INTERVAL_S: real lookups under the deadline

Only failures Redis is responsible for count (`redis_fault`): a lookup that timed out with
nothing received, a connection error, an error reply. Not this process's own: a reply that
waited unread past its grace while the loop was busy (`LoopLag`), a lane its owner closed
(`LaneClosed`); a caller's cancellation is re-raised before it gets here.

The probe is what the request path does, a lookup on the lookups' own connection with the
lookup's deadline — not a PING, which a Redis whose lookups are slow (queued behind writes, a
congested connection) answers at once: that closed the breaker every probe, three requests
paid the deadline, it opened again, and each recovery started a write-back. Coming back takes
RECOVER_AFTER good probes in a row (hysteresis), the first after PROBE_INTERVAL_S, the others
RECONFIRM_S apart; one failure starts the count again.

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

from cachemap.redis.lookups import LaneClosed, LoopLag
from gateway.tasks import BackgroundTasks

log = logging.getLogger(__name__)

DEGRADE_AFTER = 3
"""Consecutive failed lookups before the gateway stops trying Redis on the request path: one
slow reply on a busy machine is not an outage."""
PROBE_INTERVAL_S = 0.5
"""How often a degraded gateway probes Redis to come back."""
RECOVER_AFTER = 3
"""Good probes in a row before the request path uses Redis again: one fast answer from a Redis
that is slow most of the time is not a recovery."""
PROBE_LOOKUPS = 4
"""Lookups per probe, in one write; every one must be answered in time. Four round trips a
probe also teach the deadline (`deadline.LookupDeadline`) Redis's latency while it is away."""
RECONFIRM_S = 0.1
"""Between the good probes that confirm a recovery: Redis back after an outage is back within
PROBE_INTERVAL_S + 2 × RECONFIRM_S."""


def redis_fault(exc: BaseException) -> bool:
    """Whether a failed lookup is Redis's doing (else this process's: not counted)."""
    return not isinstance(exc, LoopLag | LaneClosed | asyncio.CancelledError)


@dataclass
class BreakerState:
    degraded: bool = False
    state_changes: int = 0
    consecutive_failures: int = 0
    degraded_since_s: float | None = None
    """Wall-clock time the current outage began (None while healthy)."""
    last_failure_s: float = -math.inf
    """`time.perf_counter()` when the last counted failure was noticed."""
    not_counted: int = 0
    """Failed lookups that were this process's doing (`redis_fault`), not counted."""
    probes: int = 0
    failed_probes: int = 0


class Breaker:
    def __init__(self, probe: Callable[[bool], Awaitable[None]], tasks: BackgroundTasks) -> None:
        """`probe(reconnect)` raises while the shared directory is away and returns once it
        answered a lookup in time; `reconnect` is True for the first probe of a round (the
        connections from before are dropped first)."""
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
        if not redis_fault(exc):
            state.not_counted += 1
            return
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
        good = 0
        while self.state.degraded:
            await asyncio.sleep(PROBE_INTERVAL_S if good == 0 else RECONFIRM_S)
            self.state.probes += 1
            try:
                await self._probe(good == 0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("directory probe failed: %r", exc)
                self.state.failed_probes += 1
                good = 0
                continue
            good += 1
            if good >= RECOVER_AFTER:
                self.state.consecutive_failures = 0
                answered = good * PROBE_LOOKUPS
                self._set(False, f"{good} probes in a row ({answered} lookups) answered in time")
