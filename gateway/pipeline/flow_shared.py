"""Fairness counters shared by every gateway (and worker) on one Redis (issue 43, item 6).

Each gateway's fair queue (`router.fairness.FairQueue`) orders scopes by their virtual token
counters. Alone, a gateway counts only what it served, so behind a Service that spreads a
tenant's traffic unevenly its shares hold per gateway, not over the fleet. Here each gateway
publishes what it served, batched, and adds what the others served to its own counters:

    kvg:{kvg-flow}:vtc:<band>   hash   scope -> weighted tokens served, every gateway summed

One pipeline a round (`round_s`, 0.1 s by default), only when something was served or is
tracked: HINCRBYFLOAT this gateway's service since the last round, HMGET the totals of the
scopes this gateway tracks, and PEXPIRE (idle keys go within `EXPIRE_S`). On a single Redis
the round's commands go down a connection of their own in one write (`cachemap.redis.lookups.
LookupLane.commands`), not through the client's pool: a pooled pipeline (a connection taken
and given back, the retry wrapper, the send's `wait_for`) was ~0.6 ms of a busy gateway's CPU
a round, 10 rounds a second a gateway, whatever its traffic (docs/design/directory.md, "The
tier's CPU per request"). A Cluster keeps the pipeline. For each tracked
scope, `total − what this gateway published` is what the others served; its growth since the
last round is added to the local counter (`FairQueue.add_remote`). A scope first seen here
starts from the totals as they are (the arrival lift already levels it with its band): no
jump for history.

Approximate, by design: the others' service arrives up to a round (plus a round trip) late,
and a scope that is idle here is not followed (it is lifted on its return, as without
sharing). With Redis away a round fails and the service stays in the next round's batch: the
gateways fall back to their own counters, as without sharing, and converge again once Redis
answers. What it guarantees: with every gateway's queue backlogged with the same scopes, each
picks by the fleet's counters, so the fleet's served shares converge to the weights whatever
the spread of traffic over gateways, within one round's service per scope and gateway.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from redis.asyncio.cluster import RedisCluster

from cachemap.redis.client import AnyRedis
from cachemap.redis.lookups import LookupLane
from gateway.tasks import BackgroundTasks
from router.fairness import FairQueue

log = logging.getLogger(__name__)

KEY_PREFIX = "kvg:{kvg-flow}:vtc:"
"""One hash tag: every band's hash in one Cluster slot (one pipeline)."""
EXPIRE_S = 3600
"""A band's hash goes an hour after its last service anywhere (counters then restart level:
the arrival lift would level them anyway)."""
ROUND_DEADLINE_S = 1.0
"""A round down the lane that Redis has not answered within this fails (the client's socket
timeout, which bounded the pooled pipeline)."""


def band_key(band: int) -> str:
    return f"{KEY_PREFIX}{band}"


class SharedCounters:
    """Publishes `queue`'s service and applies its peers' (module docstring)."""

    def __init__(self, client: AnyRedis, queue: FairQueue[Any], round_s: float) -> None:
        self.client = client
        self.queue = queue
        self.round_s = round_s
        queue.share()
        self._published: dict[tuple[int, str], float] = {}
        """What this gateway added to each total (since it last tracked the scope)."""
        self._applied: dict[tuple[int, str], float] = {}
        """The others' service already added to the local counter."""
        self._lane = None if isinstance(client, RedisCluster) else LookupLane(client, "", "")
        """The rounds' own connection on a single Redis (module docstring)."""
        self._tasks = BackgroundTasks("shared fairness counters")
        self.rounds = 0
        self.failed = 0

    async def round(self) -> None:
        """Publish, read, apply: one pipeline."""
        served = self.queue.take_served()
        tracked = self.queue.tracked()
        if not served and not tracked:
            return
        by_band: dict[int, list[str]] = {}
        for band, scope in tracked:
            by_band.setdefault(band, []).append(scope)
        bands = sorted({b for b, _ in served} | set(by_band))
        commands: list[tuple[Any, ...]] = [
            ("HINCRBYFLOAT", band_key(band), scope, weighted)
            for (band, scope), weighted in served.items()
        ]
        commands += [("HMGET", band_key(band), *scopes) for band, scopes in by_band.items()]
        commands += [("EXPIRE", band_key(band), EXPIRE_S) for band in bands]
        try:
            replies = await self._execute(commands)
        except Exception as exc:  # Redis away: the service waits for the next round
            self.failed += 1
            log.debug("shared fairness counters: round failed: %r", exc)
            self.queue.return_served(served)
            return
        self.rounds += 1
        for key, weighted in served.items():
            self._published[key] = self._published.get(key, 0.0) + weighted
        totals = replies[len(served) : len(served) + len(by_band)]
        seen: set[tuple[int, str]] = set()
        for (band, scopes), values in zip(by_band.items(), totals, strict=True):
            for scope, value in zip(scopes, values, strict=True):
                key = (band, scope)
                seen.add(key)
                total = float(value) if value is not None else 0.0  # none served it yet
                others = total - self._published.get(key, 0.0)
                applied = self._applied.get(key)
                self._applied[key] = others
                if applied is not None and others > applied:
                    self.queue.add_remote(scope, band, others - applied)
        # what is no longer tracked here restarts from the totals when it returns (bounded)
        for book in (self._published, self._applied):
            for key in [k for k in book if k not in seen and k not in served]:
                del book[key]

    async def _execute(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """The round's commands in one write, their replies in order (the first error
        raised)."""
        if self._lane is None:
            async with self.client.pipeline(transaction=False) as pipe:
                for command in commands:
                    pipe.execute_command(*command)
                return list(await pipe.execute())
        answers = await asyncio.gather(
            *self._lane.commands(commands, ROUND_DEADLINE_S), return_exceptions=True
        )
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        return list(answers)

    async def _loop(self) -> None:
        while True:  # bounded: cancelled by `stop`
            await asyncio.sleep(self.round_s)
            await self.round()

    def start(self) -> None:
        self._tasks.spawn(self._loop(), name="shared fairness counters")

    async def stop(self) -> None:
        await self._tasks.close()
        try:  # the last service, so the peers count it (bounded: Redis may be gone)
            await asyncio.wait_for(self.round(), 0.5)
        except Exception as exc:
            log.debug("shared fairness counters: last round failed: %r", exc)
        if self._lane is not None:
            await self._lane.close()
